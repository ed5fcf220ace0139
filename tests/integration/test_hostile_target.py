"""What a target controls cannot hurt the daemon (issue 17, points 4, 5 and 10): a flood of
unique frames stays within the session's byte budget, a symlinked /tmp in a container leads
nothing outside its root, a forked child does not hold the agent's socket, the remote-debug
opt-out is honoured for every Python version, a stopped target is said to be stopped, and what a
killed daemon left behind is cleaned at the next attach.

Real parts: real targets, real ptrace injection, a real chroot in a private mount namespace.
Needs root (ptrace, mount, chroot); probed, skipped with the reason otherwise.
"""

from __future__ import annotations

import ctypes
import gc
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from stacklens.cct.window import DEFAULT_MAX_BYTES
from stacklens.daemon.join import Joiner
from stacklens.errors import AttachError
from stacklens.inject import AgentServer, PySample, inject_agent
from stacklens.inject.server import MAX_QUEUED_BYTES

pytestmark = pytest.mark.integration

TARGETS = Path(__file__).resolve().parents[1] / "targets"
PY = sys.executable
PYENV = {v: f"/root/.pyenv/versions/{full}/bin/python{v}"
         for v, full in (("3.10", "3.10.13"), ("3.12", "3.12.1"), ("3.13", "3.13.0"))}
LOOP = "import time\nprint('ready', flush=True)\nwhile True: time.sleep(0.01)\n"
SESSION_BUDGET = DEFAULT_MAX_BYTES + MAX_QUEUED_BYTES        # 192 + 64 = 256 MiB


def _ptrace_works() -> str | None:
    child = subprocess.Popen([PY, "-c", "import time; time.sleep(30)"])
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


def start(argv, **kw):
    p = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, **kw)
    line = p.stdout.readline()
    if line != "ready\n":
        p.kill()
        raise AssertionError(f"target did not start: {line!r} {p.communicate()[1]}")
    return p


def stop(p):
    if p.poll() is None:
        p.kill()
    return p.communicate()


def wait_for(cond, timeout=30.0, what="condition"):
    """Wait for an event (``cond()`` true); ``timeout`` only bounds a broken run."""
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.005)


def status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def release_memory() -> None:
    """What the daemon does when a session ends (daemon/core.py): collect, give free heap back."""
    gc.collect()
    ctypes.CDLL(None).malloc_trim(0)


# ---- point 4: memory from a hostile target ------------------------------------------------------

FLOOD_FRAMES = 240_000     # ~380 MB of unique frame strings; without the budget the tree held 711 MB (estimate)


def test_unique_frame_flood_stays_within_the_session_budget(tmp_path):
    q = subprocess.Popen([PY, str(TARGETS / "inject_flood.py")], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    srv = AgentServer(q.pid, tmp_path / "a")
    joiner = Joiner(q.pid, agent=True)
    try:
        release_memory()
        base = status_kib("VmRSS")
        Path("/proc/self/clear_refs").write_text("5")         # VmHWM := VmRSS: the peak from here
        q.stdin.write(f"{srv.path} {srv.token} {FLOOD_FRAMES}\n")
        q.stdin.flush()
        assert q.stdout.readline() == "ready\n"
        samples = 0

        def drained() -> bool:              # the aggregation loop of a session, until the bye
            nonlocal samples
            recs = srv.poll(20_000)
            for r in recs:
                samples += isinstance(r, PySample)
                joiner.on_agent(r)
            return not recs and srv.stats().get("bye", 0) >= 1 and srv.queued_bytes == 0

        wait_for(drained, timeout=600, what="the flood and its bye")
        peak = status_kib("VmHWM") - base
        st = srv.stats()
        mem = joiner.tree.memory()
        assert st.get("rejected_oversize", 0) == 0 and st.get("rejected_message", 0) == 0, st
        # nothing held past the budget: the tree's estimate and the process's real peak
        assert mem["used_bytes"] <= DEFAULT_MAX_BYTES, mem
        assert peak * 1024 < SESSION_BUDGET, f"peak RSS growth {peak / 1024:.0f} MiB, {mem}, {st}"
        # and what the budget cost is counted where users see it
        assert mem["budget_folded_nodes"] > 0, mem
        assert st["truncated_strings"] >= FLOOD_FRAMES // 64, st
        snap = joiner.snapshot()
        assert snap.meta["memory"]["budget_folded_nodes"] == mem["budget_folded_nodes"]
        # samples are never lost to the tree's budget (only their context): every one kept by the
        # channel is counted, the rest were dropped by the channel's queue bound, counted too
        assert snap.total("py_samples") == samples
        assert samples + st.get("dropped_records", 0) == FLOOD_FRAMES // 4
        print(f"\nflood: RSS base {base / 1024:.0f} MiB, peak +{peak / 1024:.0f} MiB, tree {mem['used_bytes'] >> 20} "
              f"MiB, folded {mem['budget_folded_nodes']}, evicted {mem['evicted_buckets']}, channel drops "
              f"{st.get('dropped_records', 0)}", file=sys.stderr)
        del snap
    finally:
        q.stdin.write("exit\n")
        q.stdin.flush()
        q.communicate(timeout=30)
        srv.close()                              # the target exited: its session ends
    del joiner
    release_memory()
    back = status_kib("VmRSS") - base
    assert back * 1024 < 48 << 20, f"{back / 1024:.0f} MiB still held after the session ended"
