"""Attach/detach the in-process agent to real targets, by PID, many times in a row.

Needs ptrace of a child (probed; skipped with the reason otherwise). The CPython targets are the
venv's 3.11 and, where installed, pyenv's 3.10/3.12/3.13 and Debian sid's 3.14 in a chroot.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

import stacklens
from tests.interpreters import pyenv_python
from tests.ptrace_probe import skip_module_without_ptrace
from stacklens.errors import Timeout
from stacklens.inject.channel.server import AgentServer
from stacklens.inject.injector import inject_agent
from stacklens.records.agent import PySample

pytestmark = pytest.mark.integration

TARGETS = Path(__file__).resolve().parents[1] / "targets"
PACKAGE = str(Path(stacklens.__file__).resolve().parent)
PY = sys.executable
PYENV = {v: pyenv_python(full) for v, full in (("3.10", "3.10.13"), ("3.12", "3.12.1"), ("3.13", "3.13.0"))}
CYCLES = int(os.environ.get("STACKLENS_INJECT_CYCLES", "100"))


skip_module_without_ptrace()   # and every module that imports this one


class Target:
    def __init__(self, script: str, *args: str, python: str = PY, cwd: str | None = None,
                 argv: list[str] | None = None) -> None:
        cmd = argv or [python, str(TARGETS / script), *args]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, cwd=cwd)
        line = self.proc.stdout.readline()
        if line != "ready\n":
            self.proc.kill()
            raise AssertionError(f"target did not start: {line!r} {self.proc.stderr.read()}")
        self.pid = self.proc.pid

    def finish(self, timeout: float = 60) -> tuple[str, str]:
        out, err = self.proc.communicate(timeout=timeout)
        return "ready\n" + out, err

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.communicate()


def threads(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/task"))


def fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def wait_for(cond, timeout=30.0, what="condition"):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return
        time.sleep(0.005)
    raise AssertionError(f"timed out waiting for {what() if callable(what) else what}")


def proc_state(pid: int) -> tuple[frozenset[str], dict[int, str]]:
    """The target's threads (tids) and its fd table (fd -> what it points at): a leak check on
    these, not on counts, also catches one thing closed and another opened."""
    fdt = {}
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            fdt[int(fd)] = os.readlink(f"/proc/{pid}/fd/{fd}")
        except FileNotFoundError:
            pass
    return frozenset(os.listdir(f"/proc/{pid}/task")), fdt


def state_diff(base, now) -> str:
    (bt, bf), (nt, nf) = base, now
    gone_t, new_t = sorted(bt - nt), sorted(nt - bt)
    gone_f = sorted(set(bf.items()) - set(nf.items()))
    new_f = sorted(set(nf.items()) - set(bf.items()))
    return (f"{len(nt)} threads/{len(nf)} fds, baseline {len(bt)}/{len(bf)}; threads gone {gone_t} "
            f"new {new_t}; fds gone {gone_f} new {new_f}")


def agent_leftovers(pid: int, srv: AgentServer) -> list[str]:
    """What of ours is in the target: a thread a bootstrap named (comm "stacklens-agent"), an fd
    on the server's directory (socket, agent code) or the package. (The agent's end of the socket
    has no path: the fd table compared with the baseline catches that one.)"""
    ours = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            comm = Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()
        except OSError:
            continue
        if comm.startswith("stacklens"):
            ours.append(f"thread {tid} {comm!r}")
    for fd, link in proc_state(pid)[1].items():
        if link.startswith((srv.target_path, srv.target_agent_dir, str(srv.dir), PACKAGE)):
            ours.append(f"fd {fd} -> {link}")
    return ours


@pytest.fixture
def sockdir(tmp_path):
    d = tmp_path / "agents"
    yield d


def reference_output(script: str, stopfile: Path, python: str = PY, *args: str) -> tuple[str, str]:
    t = Target(script, str(stopfile), *args, python=python)
    stopfile.touch()
    try:
        return t.finish()
    finally:
        stopfile.unlink()


class Hold:
    """A target that offers a quiescent point (``inject_torch.py``): while ``hold`` exists it
    waits there, and says so with ``hold.held``. Its threads and fds, which come and go within
    a step, are compared there."""

    def __init__(self, path: Path) -> None:
        self.path, self.flag = path, Path(str(path) + ".held")

    def __enter__(self) -> None:
        self.path.touch()
        wait_for(self.flag.exists, 30, "the target at its quiescent point")

    def __exit__(self, *exc) -> None:
        self.path.unlink()
        wait_for(lambda: not self.flag.exists(), 30, "the target to leave its quiescent point")


def cycle_busy(script: str, tmp_path: Path, cycles: int, python: str = PY,
               quiescent: bool = False) -> dict:
    """Attach/detach ``cycles`` times. After every detach: nothing of ours left in the target
    (no agent thread, no fd on our paths), then its threads and fd table exactly as before the
    first attach — measured whenever for a target whose threads and fds never change, at the
    target's quiescent point if ``quiescent`` (its threads and fds move within a step)."""
    stop = tmp_path / "stop"
    hold = Hold(tmp_path / "hold")
    args = [str(hold.path)] if quiescent else []
    at_rest = hold if quiescent else contextlib.nullcontext()
    ref = reference_output(script, stop, python, *args)
    t = Target(script, str(stop), *args, python=python)
    srv = AgentServer(t.pid, tmp_path / "agents")
    latencies, samples = [], 0
    try:
        time.sleep(0.2)
        with at_rest:
            base = proc_state(t.pid)
        for i in range(cycles):
            r = inject_agent(t.pid, srv.path, timeout_s=10)
            latencies.append(r.latency_s)
            if i == 0:     # the leftover check does see the agent
                wait_for(lambda: any(x.endswith("'stacklens-agent'") for x in agent_leftovers(t.pid, srv)),
                         30, lambda: f"the agent's thread in the target: {agent_leftovers(t.pid, srv)}")
            time.sleep(0.02)
            assert srv.stop_agent(30), f"agent did not detach (cycle {i})"
            samples += sum(isinstance(x, PySample) for x in srv.poll())
            wait_for(lambda: not agent_leftovers(t.pid, srv), 30,
                     lambda: f"the agent gone after cycle {i}: {agent_leftovers(t.pid, srv)}")
            with at_rest:
                wait_for(lambda: proc_state(t.pid) == base, 30, lambda: f"threads/fds back to the "
                         f"baseline after cycle {i}: {state_diff(base, proc_state(t.pid))}")
        assert srv.stats().get("rejected_message", 0) == 0, srv.stats()
    finally:
        srv.close()
        stop.touch()
        hold.path.unlink(missing_ok=True)
    out = t.finish()
    assert out == ref, f"output differs from an unattached run:\n{out}\nvs\n{ref}"
    assert t.proc.returncode == 0
    return {"latencies": latencies, "samples": samples}


@pytest.mark.parametrize("script", ["inject_busy.py", "inject_alloc.py"])
def test_attach_detach_repeatedly_pure_python(script, tmp_path):
    res = cycle_busy(script, tmp_path, CYCLES)
    assert res["samples"] > 0


def test_attach_detach_repeatedly_torch_dataloader(tmp_path):
    pytest.importorskip("torch")
    # its prefetch thread and each batch's shared-memory fds come and go within an epoch: one
    # snapshot at a random moment is no baseline (a CI run failed with fewer of both than it)
    res = cycle_busy("inject_torch.py", tmp_path, CYCLES, quiescent=True)
    assert res["samples"] > 0


@pytest.mark.parametrize("version", sorted(PYENV))
def test_attach_detach_other_cpython_versions(version, tmp_path):
    if not os.path.exists(PYENV[version]):
        pytest.skip(f"no CPython {version} at {PYENV[version]}")
    cycle_busy("inject_busy.py", tmp_path, 10, python=PYENV[version])


def test_bootstrap_ran_but_no_hello_is_not_reported_as_not_executing_python(tmp_path):
    """The bootstrap names its thread in /proc, so a Timeout tells "the bootstrap never ran" (the
    main thread reached no eval-breaker check) apart from "it ran, the agent sent no hello" (here:
    the agent thread starved of the GIL by the main thread's long C calls)."""
    stop = tmp_path / "stop"
    t = Target("inject_gil_hog.py", str(stop))
    srv = AgentServer(t.pid, tmp_path / "agents")
    try:
        with pytest.raises(Timeout, match="ran the bootstrap but its agent thread sent no hello") as ei:
            inject_agent(t.pid, srv.path, timeout_s=1.5)
        assert "not executing Python" not in str(ei.value)
    finally:
        srv.close()
        stop.touch()
    assert t.finish() == ("ready\ndone\n", "")


def _blocked_attempts(t: Target, srv: AgentServer, n: int, timeout_s: float) -> None:
    """`n` injections into a target blocked in a syscall, each given up after `timeout_s` (the
    path under test is the give-up: 0.1 s is as good as 0.3, at a third of the wall time)."""
    base_threads, base_fds = threads(t.pid), fds(t.pid)
    for i in range(n):
        t0 = time.monotonic()
        with pytest.raises(Timeout, match="target not executing Python") as ei:
            inject_agent(t.pid, srv.path, timeout_s=timeout_s)
        assert time.monotonic() - t0 < timeout_s + 1.0
        assert threads(t.pid) == base_threads and fds(t.pid) == base_fds
    return ei.value


def test_main_thread_blocked_in_sleep(tmp_path):
    ref_t = Target("inject_sleep.py")
    ref_t.proc.send_signal(signal.SIGUSR1)
    ref = ref_t.finish()
    t = Target("inject_sleep.py")
    srv = AgentServer(t.pid, tmp_path / "agents")
    try:
        # "ready" comes just before the sleep: on a loaded machine the interpreter may not be in it
        # yet, and would run the pending call (x86-64: clock_nanosleep, nanosleep, select, pselect6)
        wait_for(lambda: open(f"/proc/{t.pid}/syscall").read().split()[0] in ("230", "35", "23", "270"), 30,
                 "the sleep")
        err = _blocked_attempts(t, srv, CYCLES, 0.1)
        assert "nanosleep" in str(err) or "select" in str(err), str(err)
    finally:
        srv.close()
    # the withdrawn pending calls run now, as no-ops; nothing connects, nothing is printed
    t.proc.send_signal(signal.SIGUSR1)
    assert t.finish() == ref


def test_main_thread_blocked_in_socket_recv(tmp_path):
    def run(attempts: int) -> tuple[str, str]:
        path = str(tmp_path / f"recv-{attempts}.sock")
        t = Target("inject_recv.py", path)
        c = socket.socket(socket.AF_UNIX)
        c.connect(path)
        srv = AgentServer(t.pid, tmp_path / "agents")
        try:
            wait_for(lambda: open(f"/proc/{t.pid}/syscall").read().split()[0] == "45", 30, "recv")
            if attempts:
                err = _blocked_attempts(t, srv, attempts, 0.1)
                assert "recvfrom" in str(err), str(err)
        finally:
            srv.close()
        c.sendall(b"stop")
        c.close()
        return t.finish()

    assert run(CYCLES) == run(0)


def test_sampler_profile_matches_known_split(tmp_path):
    stop = tmp_path / "stop"
    t = Target("inject_split.py", str(stop))
    srv = AgentServer(t.pid, tmp_path / "agents")
    try:
        inject_agent(t.pid, srv.path, timeout_s=10)
        time.sleep(0.5)
        srv.poll()                              # skip the start-up
        time.sleep(8.0)                         # ~800 samples: 5 points is > 3 sigma
        recs = srv.poll()
        srv.stop_agent()
    finally:
        srv.close()
        stop.touch()
    out, _ = t.finish()
    fs, gs = (float(x) for x in next(l for l in out.splitlines() if l.startswith("split ")).split()[1:])
    truth = fs / (fs + gs)  # what the target really spent (0.70 nominal; a loaded VM shifts it a little)
    assert abs(truth - 0.70) <= 0.05, f"target's own split {truth:.3f}"
    main = [r for r in recs if isinstance(r, PySample) and r.tid == t.pid]
    f = sum(any(fr[1] == "f" for fr in s.frames) for s in main)
    g = sum(any(fr[1] == "g" for fr in s.frames) for s in main)
    assert f + g > 200, (f, g)
    share = f / (f + g)
    print(f"sampler split: f={f} g={g} share={share:.3f} truth={truth:.3f}")
    assert abs(share - truth) <= 0.05, f"f share {share:.3f} (f={f}, g={g}), target's own {truth:.3f}"


SID = Path("/srv/sid")


@pytest.mark.skipif(not (SID / "usr/bin/python3.14").exists(), reason="no Debian sid chroot with python3.14 at /srv/sid")
@pytest.mark.parametrize("disable", [False, True])
def test_pep768_in_chroot(tmp_path, disable):
    """CPython 3.14 in a chroot: PEP 768 path written by us, /proc/PID/root path translation."""
    shutil.copy(TARGETS / "inject_busy.py", SID / "tmp/inject_busy.py")
    stop_in = "/tmp/stacklens-stop"
    (SID / stop_in.lstrip("/")).unlink(missing_ok=True)
    env_cmd = ["env", "PYTHON_DISABLE_REMOTE_DEBUG=1"] if disable else []
    argv = ["chroot", str(SID), *env_cmd, "python3.14", "/tmp/inject_busy.py", stop_in]
    t = Target("", argv=argv)
    pid = t.pid
    # the chroot's python is a child of chroot(1) only if chroot execs; it does (exec)
    srv = AgentServer(pid)                       # default dir: inside the target's root
    try:
        assert srv.path.startswith(f"/proc/{pid}/root/")
        if disable:
            from stacklens.errors import AttachError
            with pytest.raises(AttachError, match="disabled remote debugging"):
                inject_agent(pid, srv.path, timeout_s=5)
        else:
            for _ in range(10):
                r = inject_agent(pid, srv.path, timeout_s=10)
                assert r.method == "pep768" and r.python[:2] == (3, 14)
                # samples arrive with the agent's first flush (200 ms), later on a loaded machine:
                # wait for one (a fixed 0.2 s failed once in a fresh-clone CI run), then detach
                got = []
                wait_for(lambda: got.extend(srv.poll()) or any(isinstance(x, PySample) for x in got),
                         timeout=30, what="a Python sample from the injected agent")
                assert srv.stop_agent(30)
    finally:
        srv.close()
        (SID / stop_in.lstrip("/")).touch()
    out, err = t.finish()
    assert "mismatches=0" in out and err == ""


def test_agent_is_not_starved_by_a_main_thread_that_releases_the_gil_often(tmp_path):
    """A main thread that drops and re-takes the GIL every few ms (a stat call) wins every race for
    it, and a waiting thread never asks it to switch (it is woken, not timed out): the agent starved
    and never said hello (found with gdb, 2026-11-30). While attached the switch interval is at most
    SWITCH_INTERVAL_S; at detach it is restored."""
    from stacklens.inject.bootstrap import SWITCH_INTERVAL_S

    stop = tmp_path / "stop"
    t = Target("inject_switch.py", str(stop))
    srv = AgentServer(t.pid, tmp_path / "agents")
    try:
        for _ in range(5):
            r = inject_agent(t.pid, srv.path, timeout_s=10)
            assert r.latency_s < 2.0
            assert srv.stop_agent(30)
    finally:
        srv.close()
        time.sleep(0.3)
        stop.touch()
    out, err = t.finish()
    assert t.proc.returncode == 0, err
    seen = dict(line.split("=", 1) for line in out.splitlines()[1:])
    assert f"{SWITCH_INTERVAL_S:.6f}" in seen["seen"].split(","), out
    assert seen["final"] == "0.005000", out      # CPython's default, restored
