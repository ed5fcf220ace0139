"""Attach/detach the in-process agent to real targets, by PID, many times in a row.

Needs ptrace of a child (probed; skipped with the reason otherwise). The CPython targets are the
venv's 3.11 and, where installed, pyenv's 3.10/3.12/3.13 and Debian sid's 3.14 in a chroot.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from stacklens.errors import Timeout
from stacklens.inject import AgentServer, PySample, inject_agent

pytestmark = pytest.mark.integration

TARGETS = Path(__file__).resolve().parents[1] / "targets"
PY = sys.executable
PYENV = {v: f"/root/.pyenv/versions/{full}/bin/python{v}"
         for v, full in (("3.10", "3.10.13"), ("3.12", "3.12.1"), ("3.13", "3.13.0"))}
CYCLES = int(os.environ.get("STACKLENS_INJECT_CYCLES", "100"))


def _ptrace_works() -> str | None:
    import ctypes
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.ptrace(0x4206, child.pid, 0, 0) != 0:
            return f"ptrace(PTRACE_SEIZE) refused: errno {ctypes.get_errno()}"
        libc.ptrace(17, child.pid, 0, 0)
        return None
    finally:
        child.kill()
        child.wait()


_WHY = _ptrace_works()
if _WHY:
    pytest.skip(_WHY, allow_module_level=True)


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


def wait_for(cond, timeout=5.0, what="condition"):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return
        time.sleep(0.005)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture
def sockdir(tmp_path):
    d = tmp_path / "agents"
    yield d


def reference_output(script: str, stopfile: Path, python: str = PY) -> tuple[str, str]:
    t = Target(script, str(stopfile), python=python)
    stopfile.touch()
    try:
        return t.finish()
    finally:
        stopfile.unlink()


def cycle_busy(script: str, tmp_path: Path, cycles: int, python: str = PY) -> dict:
    stop = tmp_path / "stop"
    ref = reference_output(script, stop, python)
    t = Target(script, str(stop), python=python)
    srv = AgentServer(t.pid, tmp_path / "agents")
    latencies, samples = [], 0
    try:
        time.sleep(0.2)
        base_threads, base_fds = threads(t.pid), fds(t.pid)
        for i in range(cycles):
            r = inject_agent(t.pid, srv.path, timeout_s=10)
            latencies.append(r.latency_s)
            time.sleep(0.02)
            assert srv.stop_agent(5), f"agent did not detach (cycle {i})"
            samples += sum(isinstance(x, PySample) for x in srv.poll())
            wait_for(lambda: threads(t.pid) == base_threads and fds(t.pid) == base_fds, 5,
                     f"threads/fds back to {base_threads}/{base_fds} after cycle {i}: "
                     f"{threads(t.pid)}/{fds(t.pid)}")
        assert srv.stats().get("rejected_message", 0) == 0, srv.stats()
    finally:
        srv.close()
        stop.touch()
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
    res = cycle_busy("inject_torch.py", tmp_path, CYCLES)
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
        err = _blocked_attempts(t, srv, CYCLES, 0.3)
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
            wait_for(lambda: open(f"/proc/{t.pid}/syscall").read().split()[0] == "45", 5, "recv")
            if attempts:
                err = _blocked_attempts(t, srv, attempts, 0.3)
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
                time.sleep(0.2)
                assert srv.stop_agent(5)
                assert any(isinstance(x, PySample) for x in srv.poll())
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
            assert srv.stop_agent(5)
    finally:
        srv.close()
        time.sleep(0.3)
        stop.touch()
    out, err = t.finish()
    assert t.proc.returncode == 0, err
    seen = dict(line.split("=", 1) for line in out.splitlines()[1:])
    assert f"{SWITCH_INTERVAL_S:.6f}" in seen["seen"].split(","), out
    assert seen["final"] == "0.005000", out      # CPython's default, restored
