"""`record`'s held start (daemon/held.py): the command stops in its own exec'd image before its
first Python line, with a readable thread state, and runs on unchanged once released. Needs
ptrace of our own child only; skipped where even that is refused."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

from stacklens.errors import InputError


@pytest.fixture
def held_cls():
    from stacklens.daemon import held

    probe = subprocess.Popen([sys.executable, "-S", "-E", "-c", held._LAUNCHER, sys.executable, "python", "-c", "pass"])
    _, status = os.waitpid(probe.pid, 0)
    if not os.WIFSTOPPED(status):
        pytest.skip("ptrace(PTRACE_TRACEME) is refused here (yama ptrace_scope 3?)")
    os.kill(probe.pid, 9)
    os.waitpid(probe.pid, 0)
    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("the held start's breakpoints are x86-64")
    return held.HeldCommand


def state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as fh:
        return fh.read().rsplit(")", 1)[1].split()[0]


def test_python_is_held_before_its_first_line_with_its_thread_state_readable(held_cls):
    from stacklens.bpf.python_process import thread_state_readable

    h = held_cls([sys.executable, "-c", "print('first line ran')"], stdout=subprocess.PIPE, text=True)
    try:
        assert h.where == "first Python code" and state(h.pid) == "t"
        assert thread_state_readable(h.pid) == (True, "")
        assert os.readlink(f"/proc/{h.pid}/exe") == os.path.realpath(sys.executable)   # exec'd
        h.release()
        out = h.proc.stdout.read()
        status, cpu_ns = h.wait()
    finally:
        h.kill()
    assert out == "first line ran\n" and status == 0 and cpu_ns > 0


def test_a_native_program_is_held_at_its_entry(held_cls):
    h = held_cls(["true"])
    try:
        assert h.where == "entry" and state(h.pid) == "t" and not h.notes
        assert h.wait()[0] == 0
    finally:
        h.kill()


def test_a_missing_command_is_an_input_error(held_cls):
    with pytest.raises(InputError, match="cannot run"):
        held_cls(["/nonexistent/prog"])
