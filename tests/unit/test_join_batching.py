"""Pre-aggregated adds (WindowedCCT.stage / flush) and the Joiner's use of them (issue 9)."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stacklens.cct import Frame, WindowedCCT
from stacklens.cct import window as window_mod
from stacklens.daemon.join.joiner import Joiner
from stacklens.records.agent import JoinKind
from stacklens.daemon.join.orderjoin import SETTLE_NS, OrderJoin, launch_sig
from stacklens.records.agent import AgentStats, KernelRecord
from tests.fakes.sources import FakeEvent, py

METRICS = ("gpu_time_ns", "kernel_count", "launch_count", "cpu_samples")
A = (Frame.python("t.py", "main", 1), Frame.python("t.py", "step", 2), Frame.kernel("k"))
B = (Frame.python("t.py", "main", 1), Frame.op("aten::mm"))
C = (Frame.python("t.py", "other", 9),)


class Clock:
    def __init__(self, t: float = 0.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def values(snap) -> dict:
    return {tuple(f.label() for f in snap.path(n)): tuple(snap.exclusive(n, m) for m in snap.metrics)
            for n in range(1, snap.node_count) if any(snap.exclusive(n, m) for m in snap.metrics)}


# ---- WindowedCCT.stage / flush -------------------------------------------------------------

def test_a_snapshot_right_after_staging_sees_every_staged_value():
    w = WindowedCCT(METRICS, clock=Clock(0.5))
    i = w.metric_index("launch_count")
    for _ in range(3):
        w.stage(A, i, 1)
    w.stage_pair(A, w.metric_index("gpu_time_ns"), 700, w.metric_index("kernel_count"), 1)
    snap = w.snapshot()
    n = snap.find([f.label() for f in A])
    assert snap.exclusive(n, "launch_count") == 3
    assert snap.exclusive(n, "gpu_time_ns") == 700 and snap.exclusive(n, "kernel_count") == 1
    assert w.snapshot(window_s=1.0).total("launch_count") == 3


def test_staged_values_land_in_the_bucket_open_when_they_were_staged():
    clock = Clock(0.5)
    w = WindowedCCT(METRICS, bucket_s=1.0, horizon_s=10.0, clock=clock)
    i = w.metric_index("launch_count")
    w.stage(A, i, 5)          # bucket 0, never flushed by hand
    clock.t = 1.5
    w.stage(A, i, 2)          # bucket 1: moving there flushed the 5 into bucket 0 first
    clock.t = 2.2
    w.stage(B, i, 1)          # bucket 2
    assert w.snapshot(window_s=1.0).total("launch_count") == 1
    assert w.snapshot(window_s=2.0).total("launch_count") == 3
    assert w.snapshot(window_s=3.0).total("launch_count") == 8
    assert w.snapshot().total("launch_count") == 8
    clock.t = 20.0            # everything older than the horizon leaves the windows, not the total
    assert w.snapshot(window_s=10.0).total("launch_count") == 0
    assert w.snapshot().total("launch_count") == 8


def test_stage_rejects_an_unknown_metric_name():
    w = WindowedCCT(METRICS)
    with pytest.raises(KeyError):
        w.metric_index("bogus")


def test_equal_but_distinct_path_tuples_meet_in_one_context():
    w = WindowedCCT(METRICS, clock=Clock(0.0))
    i = w.metric_index("cpu_samples")
    w.stage(A, i, 1)
    w.stage(tuple(list(A)), i, 2)   # another tuple object, same frames
    w.add(A, "cpu_samples", 4)
    snap = w.snapshot()
    assert snap.exclusive(snap.find([f.label() for f in A]), "cpu_samples") == 7


def test_more_distinct_paths_than_stage_max_lose_nothing(monkeypatch):
    monkeypatch.setattr(window_mod, "STAGE_MAX", 8)
    w = WindowedCCT(METRICS, clock=Clock(0.0))
    i = w.metric_index("launch_count")
    paths = [(Frame.python("t.py", "f", n),) for n in range(50)]
    for p in paths * 3:
        w.stage(p, i, 1)
    assert len(w._staged) <= 8
    snap = w.snapshot()
    assert snap.total("launch_count") == 150
    assert all(snap.exclusive(snap.find([p[0].label()]), "launch_count") == 3 for p in paths)


def test_flush_under_the_node_cap_conserves_every_total():
    w = WindowedCCT(METRICS, max_nodes=40, clock=Clock(0.0))
    i = w.metric_index("launch_count")
    paths = [(Frame.python("t.py", "f", n % 7), Frame.python("t.py", "g", n)) for n in range(100)]
    for rep in range(4):
        for p in paths:
            w.stage(p, i, rep + 1)
        w.flush()
    snap = w.snapshot()
    assert snap.total("launch_count") == 100 * (1 + 2 + 3 + 4)
    assert snap.node_count <= 40


def test_a_bad_path_does_not_cost_the_others_their_values():
    w = WindowedCCT(METRICS, clock=Clock(0.0))
    i = w.metric_index("launch_count")
    w.stage(("not a frame",), i, 1)
    w.stage(A, i, 2)
    with pytest.raises(TypeError):
        w.flush()
    assert w.snapshot().total("launch_count") == 2


paths_st = st.sampled_from([A, B, C, A[:2], B[:1]])
events_st = st.lists(st.tuples(paths_st, st.sampled_from(METRICS), st.integers(0, 1000),
                               st.floats(0, 0.7), st.booleans(), st.booleans()), max_size=60)


@settings(max_examples=60, deadline=None)
@given(events_st, st.sampled_from([None, 1.0, 2.0, 3.0]))
def test_staged_adds_give_the_snapshots_plain_adds_give(evs, window_s):
    ca, cb = Clock(0.0), Clock(0.0)
    plain = WindowedCCT(METRICS, bucket_s=1.0, horizon_s=5.0, clock=ca)
    staged = WindowedCCT(METRICS, bucket_s=1.0, horizon_s=5.0, clock=cb)
    copies = {}
    for path, metric, value, dt, fresh_tuple, flush in evs:
        ca.t += dt
        cb.t += dt
        plain.add(path, metric, value)
        p = tuple(list(path)) if fresh_tuple else copies.setdefault(path, path)
        staged.stage(p, staged.metric_index(metric), value)
        if flush:
            staged.flush()
    assert values(staged.snapshot(window_s=window_s)) == values(plain.snapshot(window_s=window_s))


# ---- the Joiner ----------------------------------------------------------------------------

STACK = (py("main", 10), py("step", 20))
DIMS = dict(grid_x=8, grid_y=1, grid_z=1, block_x=256, block_y=1, block_z=1)


def launch(t, stack=STACK, name="", op="aten::add", tid=1):
    ev = FakeEvent(kind="launch", tid=tid, ktime_ns=t, api="cuLaunchKernel", op_path=(op,), py_stack=stack,
                   kernel_name=name)
    object.__setattr__(ev, "args", dict(DIMS))
    return ev


def kernel(corr, start, dur, name="k"):
    return KernelRecord(name, start, start + dur, 0, 7, corr, (8, 1, 1), (256, 1, 1), 0)


def order_joiner(t: float = 0.0):
    clock = Clock(t)
    j = Joiner(1, agent=True, join=JoinKind.ORDER, clock=clock)
    j.on_agent(AgentStats(0, 0.0, 0.0, {}, {"active": 1, "api_records": 0, "enabled_at_ns": 1}))
    return j, clock


def test_joiner_snapshot_right_after_launches_sees_them_without_a_flush():
    j, clock = order_joiner(0.5)
    for i in range(5):
        j.on_bpf(launch(1_000 + i))
    assert j.snapshot().total("launch_count") == 5
    assert j.snapshot(window_s=1.0).total("launch_count") == 5


def test_joiner_window_buckets_hold_launches_of_their_second():
    j, clock = order_joiner(0.5)
    for i in range(3):
        j.on_bpf(launch(1_000 + i))
    clock.t = 1.5
    for i in range(2):
        j.on_bpf(launch(2_000 + i))
    j.flush()
    assert j.snapshot(window_s=1.0).total("launch_count") == 2
    assert j.snapshot(window_s=2.0).total("launch_count") == 5


def test_joiner_kernels_charged_at_expire_are_in_the_next_snapshot_and_its_bucket():
    j, clock = order_joiner(0.5)
    for i in range(4):
        j.on_bpf(launch(1_000 + i * 10))
        j.on_agent(kernel(i + 1, 5_000 + i * 10, 100))
    clock.t += SETTLE_NS / 1e9 + 0.1
    j.expire(int(clock.t * 1e9))
    snap = j.snapshot()
    assert snap.total("gpu_time_ns") == 400 and snap.total("kernel_count") == 4
    assert j.snapshot(window_s=1.0).total("gpu_time_ns") == 400   # charged now: in the newest bucket
    assert j.snapshot(window_s=1.0).total("launch_count") == 0    # launched 3 s ago
    api = ["py:train.py:main:10", "py:train.py:step:20", "op:aten::add", "api:cuLaunchKernel"]
    assert snap.exclusive(snap.find(api), "launch_count") == 4   # BPF had no kernel name: CUPTI's goes below
    assert snap.exclusive(snap.find(api + ["kernel:k"]), "gpu_time_ns") == 400


def test_joiner_finish_flushes_what_it_joins():
    j, clock = order_joiner(0.5)
    j.on_bpf(launch(1_000))
    j.on_agent(kernel(1, 5_000, 100))
    j.finish()
    assert j.tree._staged == {}
    assert j.tree.snapshot().total("gpu_time_ns") == 100


def test_joiner_learns_a_handle_name_also_on_memoized_charges():
    j, clock = order_joiner(0.5)
    for i in range(3):
        j.on_bpf(launch(1_000 + i * 10, name="unresolved:0x1"))
        j.on_agent(kernel(i + 1, 5_000 + i * 10, 100, name="named"))
    j.finish()
    j._handle_names.clear()   # forgotten (a real table is bounded): a memoized charge learns it again
    j.on_bpf(launch(9_000, name="unresolved:0x1"))
    j.on_agent(kernel(4, 9_500, 100, name="named"))
    j.finish()
    assert j._handle_names == {"unresolved:0x1": "named"}
    j.on_bpf(launch(10_000, name="unresolved:0x1"))   # now named at launch
    snap = j.snapshot()
    base = ["py:train.py:main:10", "py:train.py:step:20", "op:aten::add", "api:cuLaunchKernel"]
    assert snap.exclusive(snap.find(base + ["kernel:named"]), "gpu_time_ns") == 400
    # the 4 launches counted before the name was learnt are moved onto the named node in the snapshot
    assert snap.exclusive(snap.find(base + ["kernel:named"]), "launch_count") == 1 + 4
    assert snap.find(base + ["kernel:unresolved:0x1"]) is None


def test_joiner_unseen_launches_share_one_path():
    j, clock = order_joiner(0.5)
    for i in range(3):
        j.on_agent(kernel(i + 1, 5_000 + i, 10, name=f"k{i % 2}"))
    j.finish()
    snap = j.snapshot()
    assert snap.exclusive(snap.find(["[launch not seen]", "kernel:k0"]), "gpu_time_ns") == 20
    assert snap.exclusive(snap.find(["[launch not seen]", "kernel:k1"]), "gpu_time_ns") == 10
    assert j.stats.kernels_unmatched == 3 and j.stats.kernels_joined == 0


# ---- OrderJoin internals -------------------------------------------------------------------

def test_groups_drain_in_correlation_order_whatever_the_arrival_order():
    rng = random.Random(7)
    o = OrderJoin()
    ids = list(range(1, 301))
    # mostly ascending with local swaps and a few stragglers, as buffers from two streams arrive
    for k in range(0, len(ids) - 1, 3):
        if rng.random() < 0.5:
            ids[k], ids[k + 1] = ids[k + 1], ids[k]
    ids = ids[40:] + ids[:40]
    for corr in ids:
        o.on_launch(corr * 10, ("p", corr), None)
    for corr in ids:
        o.on_kernel(kernel(corr, corr * 10 + 5, 1), 0)
    seen = []
    assert o.drain(0, lambda path, rec: seen.append((path, rec.correlation_id)), force=True) == 300
    assert [c for _, c in seen] == sorted(ids)
    assert all(path == ("p", c) for path, c in seen)
    assert not o.groups and not o.arrived and not o.run and not o.heap


def test_unsettled_groups_wait_and_the_settled_ones_go_in_order():
    o = OrderJoin()
    for corr in (1, 2, 3):
        o.on_launch(corr * 10, ("p", corr), None)
    o.on_kernel(kernel(2, 25, 1), 0)
    o.on_kernel(kernel(1, 15, 1), 0)          # arrives after a higher id: goes through the heap
    o.on_kernel(kernel(3, 35, 1), SETTLE_NS)   # arrived later: not settled at SETTLE_NS + 1
    seen = []
    assert o.drain(SETTLE_NS + 1, lambda p, r: seen.append(r.correlation_id)) == 2
    assert seen == [1, 2]
    assert o.drain(2 * SETTLE_NS, lambda p, r: seen.append(r.correlation_id)) == 1
    assert seen == [1, 2, 3]


def test_a_graph_group_is_matched_on_its_earliest_kernel():
    o = OrderJoin()
    o.on_launch(10, ("small",), (1, 1, 1, 1, 1, 1))
    o.on_launch(20, ("big",), (8, 1, 1, 256, 1, 1))
    late = KernelRecord("b", 100, 200, 0, 7, 1, (1, 1, 1), (1, 1, 1), 0)
    early = KernelRecord("a", 50, 60, 0, 7, 1, (8, 1, 1), (256, 1, 1), 0)   # the group's first kernel
    o.on_kernel(late, 0)
    o.on_kernel(early, 0)
    seen = []
    o.drain(0, lambda p, r: seen.append((p, r.name)), force=True)
    assert seen == [(("big",), "b"), (("big",), "a")]
    assert o.stats["order_sig_mismatch_skips"] == 1


def test_launch_sig_memo_and_odd_values():
    a = launch_sig(DIMS)
    assert a == (8, 1, 1, 256, 1, 1) and launch_sig(dict(DIMS)) is a
    assert launch_sig({k: str(v) for k, v in DIMS.items()}) == a
    assert launch_sig({**DIMS, "grid_x": 8.0}) == a
    assert launch_sig(None) is None and launch_sig({}) is None
    assert launch_sig({"grid_x": 1}) is None
    assert launch_sig({**DIMS, "grid_y": "x"}) is None
    assert launch_sig({**DIMS, "grid_y": [1]}) is None
