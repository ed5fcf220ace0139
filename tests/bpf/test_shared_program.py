"""One compiled BPF program serves every process attached with the same settings (bpf/shared.py,
issue 20): compiled once, each process with its own samples and counters, one detach leaving the
others attached, and nothing running once the last one is gone."""

from __future__ import annotations

import time

import pytest

from stacklens.bpf import ProbeConfig, ProbeSession
from stacklens.bpf.shared import POOL

pytestmark = pytest.mark.bpf
TARGET = "named_loop.py"
CONFIG = ProbeConfig(gpu=False, ops=False)


def _hot(events) -> set[str]:
    return {f.name for e in events for f in e.py_stack if f.name.startswith("hot_")}


def _poll_until(sessions, want: int, timeout_s: float = 120) -> dict[int, list]:
    """Events per session until each has `want` CPU samples (a bound for a busy machine)."""
    got = {s.pid: [] for s in sessions}
    deadline = time.monotonic() + timeout_s
    while any(sum(e.kind == "cpu_sample" for e in got[s.pid]) < want for s in sessions):
        assert time.monotonic() < deadline, {p: len(v) for p, v in got.items()}
        for s in sessions:
            got[s.pid] += s.poll(50)
    return got


def test_three_processes_share_one_compile_and_keep_their_own_events(bpf_ok, start_target):
    procs = [start_target(TARGET, f"hot_{i}") for i in range(3)]
    sessions: list[ProbeSession] = []
    try:
        before = POOL.compiles
        for p in procs:
            s = ProbeSession(p.pid, CONFIG)
            s.attach()
            sessions.append(s)
        assert POOL.compiles - before <= 1                # the first may find one already compiled
        shared = sessions[0]._shared
        assert all(s._shared is shared for s in sessions) and set(shared.targets) == {p.pid for p in procs}
        got = _poll_until(sessions, 10)
        for i, s in enumerate(sessions):
            assert {e.pid for e in got[s.pid]} == {s.pid}
            assert _hot(got[s.pid]) == {f"hot_{i}"}
            st = s.stats()
            assert st["samples"] >= 10 and st["drops"] == 0
        # each process's counter slot counts its own samples only
        assert len({s._attacher.slot for s in sessions}) == 3

        sessions[0].detach()
        got = _poll_until(sessions[1:], 5)               # the others keep being served
        assert all({e.pid for e in got[s.pid]} == {s.pid} for s in sessions[1:])
        assert sessions[0].pid not in shared.targets
    finally:
        for s in sessions:
            s.detach()
    # the last detach leaves the program with no target and no CPU sampler running
    assert shared.targets == () and not shared._perf
    assert len(shared.bpf[b"targets"].items()) == 0


def test_a_reattach_reuses_the_program_and_starts_from_zero(bpf_ok, start_target):
    p = start_target(TARGET, "hot_again")
    s = ProbeSession(p.pid, CONFIG)
    s.attach()
    _poll_until([s], 3)
    shared, slot = s._shared, s._attacher.slot
    assert shared.counters(slot)["samples"] >= 3
    s.detach()
    # the freed slot goes to the next target with its counters zeroed (a PID no process has)
    assert shared.add_target(4_000_000) == slot
    assert not any(shared.counters(slot).values())
    shared.remove_target(4_000_000, slot + 1)          # not its slot: nothing happens
    assert 4_000_000 in shared.targets
    shared.remove_target(4_000_000, slot)
    before = POOL.compiles
    s2 = ProbeSession(p.pid, CONFIG)
    report = s2.attach()
    try:
        assert POOL.compiles == before and s2._shared is shared
        assert any("compiled before" in n for n in report.notes)
        _poll_until([s2], 3)
    finally:
        s2.detach()


def test_prepare_compiles_ahead_and_attaches_nothing(bpf_ok, start_target):
    """The daemon's warm-up (Daemon.warm_up → ProbeSession.prepare): the program an attach would
    compile is compiled and kept, nothing is attached to the process, and the attach after it
    compiles nothing."""
    config = ProbeConfig(gpu=False, ops=False, cpu_sample_hz=97)   # a key no other test uses
    p = start_target(TARGET, "hot_warm")
    before = POOL.compiles
    assert ProbeSession(p.pid, config).prepare() is True
    assert POOL.compiles == before + 1
    assert ProbeSession(p.pid, config).prepare() is False      # found, not compiled again
    s = ProbeSession(p.pid, config)
    report = s.attach()
    try:
        assert POOL.compiles == before + 1 and any("compiled before" in n for n in report.notes)
        _poll_until([s], 3)
    finally:
        s.detach()


def test_prepare_leaves_an_attached_process_served(bpf_ok, start_target):
    """A warm-up of a process that is attached already (the daemon skips those; this is the
    safety under it) must not take the process off the program it shares."""
    p = start_target(TARGET, "hot_kept")
    s = ProbeSession(p.pid, CONFIG)
    s.attach()
    try:
        assert ProbeSession(p.pid, CONFIG).prepare() is False
        assert p.pid in s._shared.targets
        _poll_until([s], 3)
    finally:
        s.detach()
