"""The probes' estimated cost to a process (daemon/overhead.py, issue 42): the arithmetic over
two readings (hits between them, each program's mean run time per hit so far), and what an
estimate says when a part of it was not measured."""

from __future__ import annotations

import pytest

from stacklens.daemon import stacklens_pb2 as pb
from stacklens.daemon.client import ps_lines
from stacklens.daemon.overhead import STEP_S, CostMeter, Reading


class Node:
    def __init__(self, trap_ns=800.0, stats_error="", trap_error=""):
        self.trap_ns, self.stats_error, self.trap_error = trap_ns, stats_error, trap_error


def reading(t, cpu_ns, api, op=0, samples=0, api_run=(0, 0), op_run=(0, 0), cpu_run=(0, 0)):
    return Reading(t, cpu_ns, api_hits=api, op_hits=op, samples=samples,
                   runs={"api": api_run, "op": op_run, "cpu": cpu_run})


def test_the_cost_is_hits_times_trap_plus_run_time_over_the_cpu_time_used():
    m = CostMeter(Node(trap_ns=800.0))
    first = m.estimate(reading(0.0, 0, 0))
    assert first.share is None and "measuring" in first.why
    # 10,000 launches at 1,200 ns of BPF each, 1,000 op hits at 300 ns, 50 samples at 4,000 ns,
    # in 0.1 s of the process's CPU time
    est = m.estimate(reading(STEP_S + 1, 100_000_000, 10_000, op=1_000, samples=50,
                             api_run=(12_000_000, 10_000), op_run=(300_000, 1_000), cpu_run=(200_000, 50)))
    cost = 10_000 * (800 + 1_200) + 1_000 * (800 + 300) + 50 * 4_000
    assert est.share == pytest.approx(cost / 100_000_000)
    assert est.seconds == pytest.approx(STEP_S + 1)
    assert est.why == "probes only (the agent's cost is not measured)"


def test_a_trap_that_could_not_be_timed_is_left_out_and_said():
    m = CostMeter(Node(trap_ns=None, trap_error="OSError: no memfd"))
    m.estimate(reading(0.0, 0, 0))
    est = m.estimate(reading(STEP_S, 10_000_000, 1_000, api_run=(1_000_000, 1_000)))
    assert est.share == pytest.approx(1_000 * 1_000 / 10_000_000)
    assert "the uprobe trap is not in it (OSError: no memfd)" in est.why


def test_no_statistics_or_no_cpu_time_gives_no_number_and_the_reason():
    m = CostMeter(Node())
    m.estimate(reading(0.0, 0, 0))
    assert "run time is sampled" in m.estimate(reading(STEP_S, 10, 10)).why      # no run timed yet
    off = CostMeter(Node(stats_error="BPF run-time statistics unavailable: EPERM"))
    off.estimate(reading(0.0, 0, 0))
    est = off.estimate(reading(STEP_S, 10, 10))
    assert est.share is None and est.why == "BPF run-time statistics unavailable: EPERM"
    idle = CostMeter(Node())
    idle.estimate(reading(0.0, 5, 0))
    est = idle.estimate(reading(STEP_S, 5, 0))
    assert est.share is None and "no CPU time" in est.why


def test_the_estimate_covers_a_recent_span_not_the_whole_session():
    m = CostMeter(Node(trap_ns=0.0))
    for t in range(0, 100, 5):       # a reading every 5 s; the rate changes at t = 60
        hits = t * 1000 if t <= 60 else 60_000 + (t - 60) * 100
        m.estimate(reading(float(t), t * 10_000_000, hits, api_run=(1_000, 1)))      # 1 µs a hit
    est = m.estimate(reading(100.0, 1_000_000_000, 64_000, api_run=(1_000, 1)))
    assert est.seconds <= 35.0
    # 100 hits/s x 1 µs over 10 ms of CPU per s: 1%, not the session's average
    assert est.share == pytest.approx(0.01, rel=0.05)


def test_ps_shows_the_cost_column_and_why_it_is_missing():
    measured = pb.ProcessInfo(pid=10, comm="decode", attached=True, state="attached", probe_overhead=0.123,
                              overhead_note="probes only (the agent's cost is not measured)")
    waiting = pb.ProcessInfo(pid=11, comm="train", attached=True, state="attached",
                             overhead_note="measuring (the first 2 s)")
    other = pb.ProcessInfo(pid=12, comm="idle", state="not attached")
    lines = ps_lines([measured, waiting, other])
    assert "COST%" in lines[0]
    row = {ln.split()[0]: ln for ln in lines[1:] if ln.split()[0].isdigit()}
    col = lines[0].index("COST%")
    assert row["10"][col:col + 6].strip() == "12.3"
    assert row["11"][col:col + 6].strip() == "n/a"
    assert row["12"][col:col + 6].strip() == "-"
    assert any("cost: measuring" in ln for ln in lines)
