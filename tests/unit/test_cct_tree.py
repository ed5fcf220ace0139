"""The CCT: insertion, snapshots, inclusive values, node cap folding."""

from __future__ import annotations

import threading
from collections import Counter, defaultdict

import pytest
from hypothesis import given
from hypothesis import strategies as st

from stacklens.cct import CCT, METRICS, Frame, Snapshot

FRAMES = (
    Frame.python("train.py", "main", 10),
    Frame.python("train.py", "step", 20),
    Frame.op("aten::addmm"),
    Frame.native("libtorch_cuda.so", "at::native::addmm_out"),
    Frame.api("cuLaunchKernel"),
    Frame.kernel("ampere_sgemm_128x64"),
)
USED = METRICS[:4]

paths = st.lists(st.sampled_from(FRAMES), max_size=5).map(tuple)
events = st.lists(st.tuples(paths, st.sampled_from(USED), st.integers(0, 10**9)), max_size=80)


def feed(tree: CCT, evs) -> CCT:
    for path, metric, value in evs:
        tree.add(path, metric, value)
    return tree


def totals(evs) -> Counter:
    out: Counter = Counter()
    for _path, metric, value in evs:
        out[metric] += value
    return out


def by_path(evs) -> dict:
    out: dict = defaultdict(Counter)
    for path, metric, value in evs:
        out[path][metric] += value
    return {p: {m: v for m, v in c.items() if v} for p, c in out.items() if any(c.values())}


def snap_paths(snap: Snapshot) -> dict:
    return {p: {m: v for m, v in vals.items() if v} for p, vals in snap.iter_paths()}


def check_inclusive(snap: Snapshot) -> None:
    for metric in snap.metrics:
        for node in range(snap.node_count):
            below = sum(snap.inclusive(c, metric) for c in snap.children(node))
            assert snap.inclusive(node, metric) == snap.exclusive(node, metric) + below


@given(events)
def test_inclusive_is_exclusive_plus_children(evs) -> None:
    snap = feed(CCT(), evs).snapshot()
    check_inclusive(snap)
    for metric in snap.metrics:
        assert snap.total(metric) == totals(evs)[metric]
    assert snap_paths(snap) == by_path(evs)


@given(events, st.integers(2, 12))
def test_node_cap_folds_and_conserves_totals(evs, max_nodes) -> None:
    tree = CCT(max_nodes=max_nodes)
    capped_at_some_point = False
    for path, metric, value in evs:
        tree.add(path, metric, value)
        assert tree.node_count <= max_nodes
    unlimited = feed(CCT(max_nodes=None), evs)
    capped_at_some_point = unlimited.node_count > max_nodes
    snap, truth = tree.snapshot(), unlimited.snapshot()
    check_inclusive(snap)
    for metric in USED:
        assert snap.total(metric) == truth.total(metric)
    assert (snap.folded_nodes > 0) == capped_at_some_point
    # Folding only ever moves values into [other] nodes: every surviving context holds at most
    # what it really had, inclusive of its subtree.
    for node in range(1, snap.node_count):
        path = snap.path(node)
        if Frame.other("other") in path:
            continue
        real = truth.find([f.label() for f in path])
        assert real is not None
        for metric in USED:
            assert snap.exclusive(node, metric) <= truth.exclusive(real, metric)
            assert snap.inclusive(node, metric) <= truth.inclusive(real, metric)


def test_folding_takes_the_coldest_and_counts_them() -> None:
    tree = CCT(metrics=("cpu_samples",), max_nodes=5)
    for i in range(10):
        tree.add((Frame.op(f"c{i}"),), "cpu_samples", i + 1)
    snap = tree.snapshot()
    kept = {snap.frame_of(n).label(): snap.exclusive(n, "cpu_samples") for n in snap.children(0)}
    # c4 finds the tree full (5 nodes) with no [other]: folding back to 90% of the cap (4)
    # takes c0 (creating [other]) and c1, then c4 gets in. c5 is turned away into [other]
    # (max_nodes/10 turned away, at least one, sets off a fold), so c6 folds the coldest (c2)
    # and gets in; c7 turned away, c8 folds c3 and gets in, c9 turned away.
    assert kept == {"[other]": 1 + 2 + 3 + 6 + 4 + 8 + 10, "op:c4": 5, "op:c6": 7, "op:c8": 9}
    assert snap.folded_nodes == 7
    assert snap.total("cpu_samples") == 55


def test_folding_keeps_context_with_a_per_parent_other() -> None:
    tree = CCT(metrics=("gpu_time_ns",), max_nodes=8)
    step = Frame.python("train.py", "step", 3)
    tree.add((step, Frame.op("aten::mm")), "gpu_time_ns", 1_000_000)
    for i in range(10):
        tree.add((step, Frame.kernel(f"tiny{i}")), "gpu_time_ns", 1)
    snap = tree.snapshot()
    assert snap.find(["py:train.py:step:3", "[other]"]) is not None
    assert snap.exclusive(snap.find(["py:train.py:step:3", "op:aten::mm"]), "gpu_time_ns") == 1_000_000
    assert snap.total("gpu_time_ns") == 1_000_010


def test_add_many_and_unknown_metrics() -> None:
    tree = CCT()
    path = FRAMES[:3]
    tree.add_many(path, {"launch_count": 1, "api_cpu_ns": 850})
    tree.add_many(path, {"launch_count": 1, "api_cpu_ns": 150})
    with pytest.raises(KeyError, match="bogus"):
        tree.add_many(path, {"launch_count": 5, "bogus": 1})
    with pytest.raises(KeyError, match="bogus"):
        tree.add(path, "bogus", 1)
    with pytest.raises(KeyError, match="bogus"):
        tree.add(FRAMES[:4], "bogus", 1)
    snap = tree.snapshot()
    node = snap.find([f.label() for f in path])
    assert snap.exclusive(node, "launch_count") == 2  # the failed add_many left nothing behind
    assert snap.exclusive(node, "api_cpu_ns") == 1000
    assert snap.node_count == 4  # the failed first insertion of FRAMES[:4] created no node


def test_paths_must_hold_frames() -> None:
    with pytest.raises(TypeError, match="Frame"):
        CCT().add((("python", "f", "a.py", 1),), "cpu_samples", 1)


def test_snapshot_api() -> None:
    tree = CCT()
    a, b, c = FRAMES[0], FRAMES[2], FRAMES[5]
    tree.add((a, b, c), "gpu_time_ns", 30)
    tree.add((a, b), "api_cpu_ns", 7)
    tree.add((a, c), "gpu_time_ns", 5)
    snap = tree.snapshot(meta={"pid": 1234}, unavailable={"alloc_bytes"})
    assert snap.metrics == METRICS
    assert snap.root == 0 and snap.parent(0) == -1
    assert snap.node_count == 5
    assert snap.unavailable == frozenset({"alloc_bytes"})
    assert snap.meta == {"pid": 1234} and snap.folded_nodes == 0
    ab = snap.find([a.label(), b.label()])
    abc = snap.find([a.label(), b.label(), c.label()])
    assert snap.parent(abc) == ab and snap.children(ab) == (abc,)
    assert snap.path(abc) == (a, b, c) and snap.frame_of(abc) == c
    assert snap.inclusive(ab, "gpu_time_ns") == 30 and snap.exclusive(ab, "gpu_time_ns") == 0
    assert snap.total("gpu_time_ns") == 35
    assert snap.find([a.label(), "op:nothing"]) is None
    assert snap.top("gpu_time_ns", 5) == [abc, snap.find([a.label(), c.label()])]
    assert snap.top("gpu_time_ns", 1, exclusive=False) == [snap.find([a.label()])]
    assert dict((p, v["gpu_time_ns"]) for p, v in snap.iter_paths()) == {(a, b, c): 30, (a, b): 0, (a, c): 5}
    with pytest.raises(KeyError, match="nope"):
        snap.total("nope")
    with pytest.raises(ValueError):
        tree.snapshot(unavailable={"nope"})


def test_snapshot_is_immutable_and_independent() -> None:
    tree = CCT()
    meta = {"pid": 1, "cmd": ["python", "train.py"]}
    tree.add(FRAMES[:2], "cpu_samples", 1)
    snap = tree.snapshot(meta=meta)
    meta["cmd"].append("--changed")
    for _ in range(100):
        tree.add(FRAMES[:2], "cpu_samples", 1)
        tree.add(FRAMES[:4], "cpu_samples", 1)
    assert snap.total("cpu_samples") == 1 and snap.node_count == 3
    assert snap.meta == {"pid": 1, "cmd": ["python", "train.py"]}
    with pytest.raises(AttributeError):
        snap.node_count = 5  # type: ignore[misc]


def test_snapshot_read_while_the_tree_grows() -> None:
    tree = CCT()
    feed(tree, [(FRAMES[:k], "cpu_samples", 1) for k in range(6)])
    snap = tree.snapshot()
    expected = [(snap.path(n), snap.inclusive(n, "cpu_samples")) for n in range(snap.node_count)]
    seen: list = []

    def reader() -> None:
        for _ in range(200):
            seen.append([(snap.path(n), snap.inclusive(n, "cpu_samples")) for n in range(snap.node_count)])

    thread = threading.Thread(target=reader)
    thread.start()
    for i in range(5000):
        tree.add(FRAMES[: i % 6] + (Frame.op(f"x{i % 50}"),), "cpu_samples", 1)
    thread.join()
    assert all(s == expected for s in seen)


def test_repeated_paths_hit_the_cache() -> None:
    tree = CCT()
    path = FRAMES[:4]
    tree.add(path, "cpu_samples", 1)
    copy = tuple(Frame(*f) for f in path)  # equal but distinct objects, as from a new event
    tree.add(copy, "cpu_samples", 2)
    assert len(tree._leaf_of) == 1 and tree.node_count == 5
    assert tree.snapshot().total("cpu_samples") == 3


def test_root_values_and_empty_tree() -> None:
    tree = CCT()
    snap = tree.snapshot()
    assert snap.node_count == 1 and snap.total("gpu_time_ns") == 0 and list(snap.iter_paths()) == []
    tree.add((), "cpu_samples", 4)
    assert tree.snapshot().exclusive(0, "cpu_samples") == 4


def test_bad_construction() -> None:
    with pytest.raises(ValueError):
        CCT(max_nodes=1)
    with pytest.raises(ValueError):
        CCT(metrics=("a", "a"))
    with pytest.raises(ValueError):
        CCT(metrics=())


def test_a_full_tree_turns_new_contexts_away_into_the_nearest_other() -> None:
    step = Frame.python("train.py", "step", 3)
    tree = CCT(metrics=("gpu_time_ns",), max_nodes=20)
    for i in range(18):  # root + step + 18 kernels: full
        tree.add((step, Frame.kernel(f"k{i}")), "gpu_time_ns", 100)
    # No [other] on the path and no room: fold back to 18 nodes (k17 into step/[other], which
    # saves nothing, then k16, k15), and the newcomer gets in; so does the next one.
    tree.add((step, Frame.kernel("x")), "gpu_time_ns", 1)
    tree.add((step, Frame.kernel("y")), "gpu_time_ns", 1)
    assert tree.node_count == 20 and tree.folded_nodes == 3
    # Full again, and step/[other] is on the path: charged there, nothing created.
    late = (step, Frame.kernel("z"), Frame.kernel("deeper"))
    for _ in range(3):
        tree.add(late, "gpu_time_ns", 7)
    snap = tree.snapshot()
    assert snap.node_count == 20
    other = snap.find(["py:train.py:step:3", "[other]"])
    assert snap.exclusive(other, "gpu_time_ns") == 3 * 100 + 3 * 7
    assert snap.find(["py:train.py:step:3", "kernel:z"]) is None
    assert snap.folded_nodes == 3 + 2  # z and deeper were never created
    assert snap.total("gpu_time_ns") == 18 * 100 + 2 + 21


def test_surviving_contexts_keep_their_cache_entries_across_a_fold() -> None:
    tree = CCT(metrics=("cpu_samples",), max_nodes=30)
    hot = (FRAMES[0], FRAMES[1])
    tree.add(hot, "cpu_samples", 1000)
    for i in range(40):
        tree.add((FRAMES[2], Frame.op(f"cold{i}")), "cpu_samples", 1)
    assert tree.folded_nodes > 0
    assert hot in tree._leaf_of
    snap = tree.snapshot()
    assert snap.path(tree._leaf_of[hot]) == hot
