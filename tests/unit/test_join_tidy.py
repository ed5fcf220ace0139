"""CCT.add_row (what WindowedCCT.flush applies) and the sorted insertions of the joins (bisect)."""

from __future__ import annotations

import pytest

from stacklens.cct import CCT, Frame
from stacklens.daemon.join.joiner import Joiner
from stacklens.daemon.join.orderjoin import OrderJoin, kernel_sig, launch_sig
from stacklens.records.agent import ApiRecord, KernelRecord
from tests.fakes.sources import FakeEvent, py

METRICS = ("gpu_time_ns", "kernel_count", "launch_count")
A = (Frame.python("t.py", "main", 1), Frame.kernel("k"))
B = (Frame.python("t.py", "main", 1), Frame.op("aten::mm"))


def excl(tree: CCT, path) -> tuple:
    snap = tree.snapshot()
    n = snap.find([f.label() for f in path])
    return tuple(snap.exclusive(n, m) for m in snap.metrics)


# ---- CCT.add_row ---------------------------------------------------------------------------

def test_add_row_adds_by_metric_index_new_and_seen_paths_alike():
    t = CCT(METRICS, max_nodes=None)
    t.add_row(A, [5, 1, 0])
    t.add_row(tuple(list(A)), [7, 1, 2, "ignored: past the last metric"])
    assert excl(t, A) == (12, 2, 2)


def test_add_row_matches_add_many_including_zero_rows():
    rows = [(A, [0, 0, 0]), (B, [3, 0, 1]), (A, [1, 1, 0]), (B[:1], [0, 0, 4])]
    by_row, by_many = CCT(METRICS, None), CCT(METRICS, None)
    for path, values in rows:
        by_row.add_row(path, values)
        by_many.add_many(path, {m: v for m, v in zip(METRICS, values) if v})
    assert by_row.node_count == by_many.node_count == 4  # a zero row still makes its context
    assert by_row.snapshot() == by_many.snapshot()


def test_add_row_under_the_node_cap_conserves_every_total():
    t = CCT(METRICS, max_nodes=20)
    paths = [(Frame.python("t.py", "f", n % 5), Frame.python("t.py", "g", n)) for n in range(60)]
    for rep in range(3):
        for p in paths:
            t.add_row(p, [rep + 1, 1, 0])
    snap = t.snapshot()
    assert snap.total("gpu_time_ns") == 60 * 6 and snap.total("kernel_count") == 180
    assert snap.node_count <= 20


def test_add_row_rejects_a_path_that_is_not_frames():
    t = CCT(METRICS)
    with pytest.raises(TypeError):
        t.add_row(("not a frame",), [1, 0, 0])


# ---- sorted insertion: after equal times ---------------------------------------------------

def test_order_join_inserts_a_late_launch_after_equal_times_and_keeps_deques_aligned():
    o = OrderJoin()
    for t, name in ((10, "a"), (20, "b"), (20, "c"), (30, "d"), (20, "e"), (5, "f"), (30, "g")):
        o.on_launch(t, (name,), (t,))
    assert list(o.times) == [5, 10, 20, 20, 20, 30, 30]
    assert [p[0] for p in o.paths] == ["f", "a", "b", "c", "e", "d", "g"]
    assert [s[0] for s in o.sigs] == list(o.times)


def test_joiner_pending_queue_inserts_after_equal_times():
    j = Joiner(1, agent=True)
    for t, fn in ((100_000, "a"), (200_000, "b"), (200_000, "c"), (300_000, "d"), (200_000, "e"), (50_000, "f")):
        j.on_bpf(FakeEvent(kind="launch", tid=1, ktime_ns=t, api="cuLaunchKernel", py_stack=(py(fn, 1),),
                           kernel_name="k"))
    q = j.gpu_join.pending[1]
    assert [p.ktime_ns for p in q] == [50_000, 100_000, 200_000, 200_000, 200_000, 300_000]
    assert [p.path[0].name for p in q] == ["f", "a", "b", "c", "e", "d"]
    # an API record ending at 200 us claims the last launch entered by then: "e", the late one
    j.on_agent(ApiRecord("driver", "cuLaunchKernel", 1, 150_000, 200_000, 42))
    j.on_agent(KernelRecord("k", 1_000, 1_500, 0, 7, 42))
    snap = j.snapshot()
    n = snap.find(["py:train.py:e:1", "api:cuLaunchKernel", "kernel:k"])
    assert n is not None and snap.exclusive(n, "gpu_time_ns") == 500


# ---- signatures ----------------------------------------------------------------------------

def test_kernel_sig_of_tuples_and_of_other_sequences():
    k = KernelRecord("k", 0, 1, 0, 7, 1, (8, 1, 1), (256, 1, 1))
    assert kernel_sig(k) == (8, 1, 1, 256, 1, 1)
    lists = KernelRecord("k", 0, 1, 0, 7, 1, [8, 1, 1], [256, 1, 1])
    assert kernel_sig(lists) == kernel_sig(k) and type(kernel_sig(lists)) is tuple


def test_launch_sig_of_what_is_not_a_mapping_of_dimensions():
    assert launch_sig([1, 2, 3]) is None
    assert launch_sig("grid") is None
    assert launch_sig({"grid_x": 1, "grid_y": 1, "grid_z": 1, "block_x": {}, "block_y": 1, "block_z": 1}) is None
