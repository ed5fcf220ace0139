"""Advice through the daemon divides by the snapshot's window (issue 41, point 5): a held
session's snapshot says how long it covers (meta window_s), so a sync stall is a share of that
window, not of the busiest thread's CPU time (which a mostly idle job makes far shorter: a
synthetic case read 0.195 instead of 0.05)."""

from __future__ import annotations

import time

import pytest

from stacklens.analyzer.view import View
from stacklens.daemon.client import DaemonClient
from stacklens.daemon.session import ProcessSession
from tests.fakes.sources import FakeEvent, FakeProbes, py

LINE = (py("main", 1), py("step", 7))
WAIT_NS = 100_000_000
WINDOW_S = 2.0


def probes(pid, **kw):
    """20 CPU samples (0.2 s at 99 Hz) and one 100 ms sync on the step line."""
    p = FakeProbes(pid, **kw)
    p.push(*[FakeEvent(kind="cpu_sample", tid=pid, py_stack=LINE) for _ in range(20)],
           FakeEvent(kind="sync", tid=pid, api="cuCtxSynchronize", py_stack=LINE, duration_ns=WAIT_NS))
    return p


@pytest.fixture
def session_factory():
    return lambda pid, **kw: ProcessSession(pid, probe_factory=probes, **kw)


def test_advice_through_the_daemon_divides_by_the_snapshots_window(daemon, target):
    with DaemonClient(daemon.socket_path) as c:
        c.attach(target)
        attached = time.monotonic()
        while time.monotonic() - attached < WINDOW_S or not c.snapshot(target).total("sync_wait_ns"):
            time.sleep(0.05)     # until the session has covered WINDOW_S and holds the sync
        snap = c.snapshot(target)
        window_s = snap.meta["window_s"]
        assert window_s >= WINDOW_S
        view = View(snap)
        assert view.wall_source == "meta.window_s" and view.wall_ns == pytest.approx(window_s * 1e9)
        [sync] = [f for f in c.advice(target) if f.rule == "sync_stalls"]
        ev = {e.metric: e.value for e in sync.evidence}
        # 100 ms of 2+ s: at most 0.05 (the busiest thread's 0.2 s of CPU would make it 0.5)
        assert ev["wait_share"] == pytest.approx(WAIT_NS / 1e9 / ev["wall_ns"] * 1e9, rel=0.05)
        assert ev["wait_share"] <= 0.05 * 1.05 and ev["wall_ns"] >= WINDOW_S * 1e9
