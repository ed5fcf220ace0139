"""py-spy beside stacklens on one target, for the bpf tier's comparisons (root + eBPF, py-spy
installed; skipped with the reason without them): where the tools are, and one recording by both
over the same window. py-spy reads the target with process_vm_readv, --nonblocking: the target is
never stopped."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest


def tool(name: str, hint: str) -> str:
    """Where `name` is (PATH, the venv, /usr/bin), or a skip that says how to install it."""
    path = shutil.which(name) or next((str(p) for p in (Path(sys.executable).parent / name, Path("/usr/bin") / name)
                                       if p.exists()), None)
    if path is None:
        pytest.skip(f"{name} is not installed ({hint})")
    return path


def py_spy() -> str:
    return tool("py-spy", "bash scripts/setup.sh installs it: pip install py-spy")


def wait_until(cond, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"no {what} in {timeout_s:g}s"
        time.sleep(0.05)


def _realtime() -> None:
    try:
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(10))
    except OSError:
        pass   # not allowed: py-spy runs as it is (noisier on a busy machine)


def record_beside(pyspy: str, session, raw: Path, *, rate: int, min_samples: int, timeout_s: float,
                  gil: bool = True, mark: Callable[[], None] | None = None):
    """Runs `py-spy record --format raw` of the session's process at `rate` Hz into `raw` while the
    (started) `session` samples, until the session has `min_samples` CPU samples more than at
    py-spy's start; returns the session's snapshots at py-spy's start and after its exit.
    `gil`: py-spy counts only the thread holding the GIL. `mark()`, where given, is called as the
    window starts and as it ends (to have the target account for the same window)."""
    spy = subprocess.Popen([pyspy, "record", "--pid", str(session.pid), "--rate", str(rate), "--nonblocking",
                            *(["--gil"] if gil else []), "--format", "raw", "-o", str(raw)],
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, preexec_fn=_realtime)
    try:
        assert "Sampling process" in spy.stdout.readline()   # py-spy samples from here
        before = session.snapshot()
        if mark:
            mark()
        wait_until(lambda: session.stats()["cpu_samples"] - before.total("cpu_samples") >= min_samples,
                   timeout_s=timeout_s, what="stacklens' samples")
        if mark:
            mark()
        spy.send_signal(signal.SIGINT)   # py-spy writes its file on ^C
        out = spy.communicate(timeout=60)[0]
    finally:
        spy.kill()
    after = session.snapshot()
    assert spy.returncode == 0, out
    return before, after
