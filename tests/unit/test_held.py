"""`record`'s held start (cli/held.py): the command stops in its own exec'd image before its
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
    from stacklens.cli import held

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
    from stacklens.pystacks.python_process import thread_state_readable

    h = held_cls([sys.executable, "-c", "print('first line ran')"], stdout=subprocess.PIPE, text=True)
    try:
        assert h.where == "program's first line" and state(h.pid) == "t"
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


def test_a_script_is_held_after_the_interpreter_start_up_before_its_first_line(held_cls, tmp_path):
    """The start-up (site and its .pth imports) runs before the probes attach: its freed module
    code objects cannot come back as `[stale code object]` samples; the script has not begun."""
    script = tmp_path / "prog.py"
    marker = tmp_path / "ran"
    script.write_text(f"open({str(marker)!r}, 'w').close()\nimport sys\nprint('site' in sys.modules)\n")
    h = held_cls([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        assert h.where == "program's first line" and state(h.pid) == "t"
        assert not marker.exists()
        h.release()
        out = h.proc.stdout.read()
        assert h.wait()[0] == 0
    finally:
        h.kill()
    assert marker.exists() and out == "True\n"


def test_a_module_run_with_dash_m_is_held_at_its_first_python_code(held_cls):
    h = held_cls([sys.executable, "-m", "json.tool", "--help"], stdout=subprocess.PIPE, text=True)
    try:
        assert h.where == "first Python code"
        h.release()
        h.proc.stdout.read()
        assert h.wait()[0] == 0
    finally:
        h.kill()


def test_the_command_line_tells_which_entry_starts_the_program():
    from stacklens.cli.held import RUN_FILE, RUN_STRING, _main_entry

    assert _main_entry(["python3", "prog.py", "-c", "x"]) == RUN_FILE
    assert _main_entry(["python3", "-u", "-X", "dev", "-W", "error", "prog.py"]) == RUN_FILE
    assert _main_entry(["python3", "-Xdev", "-c", "pass"]) == RUN_STRING
    assert _main_entry(["python3", "-uc", "pass"]) == RUN_STRING
    assert _main_entry(["python3", "-Bm", "pkg"]) is None
    assert _main_entry(["python3", "-W", "m", "prog.py"]) == RUN_FILE        # -W's value, not -m
    assert _main_entry(["python3", "--check-hash-based-pycs", "always", "--", "p.py"]) == RUN_FILE
    assert _main_entry(["python3"]) is None and _main_entry(["python3", "-"]) is None   # stdin, the REPL
