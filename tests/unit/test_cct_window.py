"""merge / diff of snapshots and the WindowedCCT's cumulative and sliding views."""

from __future__ import annotations

import math
from collections import Counter, defaultdict

import pytest
from hypothesis import given
from hypothesis import strategies as st

from stacklens.cct import CCT, METRICS, Frame, Snapshot, WindowedCCT, diff, merge

FRAMES = (
    Frame.python("train.py", "step", 20),
    Frame.op("aten::addmm"),
    Frame.op("aten::relu"),
    Frame.native("libcudart.so.12", "cudaLaunchKernel"),
    Frame.kernel("sgemm"),
)
USED = ("gpu_time_ns", "launch_count", "cpu_samples")

paths = st.lists(st.sampled_from(FRAMES), max_size=4).map(tuple)
events = st.lists(st.tuples(paths, st.sampled_from(USED), st.integers(-1000, 10**6)), max_size=40)
metas = st.dictionaries(st.sampled_from(["pid", "comm", "gpu"]), st.integers(0, 2), max_size=3)


def tree_of(evs, metrics=METRICS) -> CCT:
    tree = CCT(metrics, max_nodes=None)
    for path, metric, value in evs:
        if metric in metrics:
            tree.add(path, metric, value)
    return tree


def snap_of(evs, meta=None, unavailable=(), metrics=METRICS) -> Snapshot:
    return tree_of(evs, metrics).snapshot(meta=meta, unavailable=unavailable)


def values(snap: Snapshot) -> dict:
    return {p: {m: v for m, v in vals.items() if v} for p, vals in snap.iter_paths()}


@given(events, events, events, metas, metas, metas)
def test_merge_is_associative_and_commutative(ea, eb, ec, ma, mb, mc) -> None:
    a, b, c = snap_of(ea, ma), snap_of(eb, mb), snap_of(ec, mc)
    assert merge(a, b) == merge(b, a)
    assert merge(merge(a, b), c) == merge(a, merge(b, c))
    assert values(merge(merge(a, b), c)) == values(snap_of(ea + eb + ec))


@given(events, events)
def test_diff_plus_b_is_a(ea, eb) -> None:
    a, b = snap_of(ea, {"pid": 1}), snap_of(eb, {"pid": 1})
    d = diff(a, b)
    assert merge(d, b) == a
    for metric in USED:
        assert d.total(metric) == a.total(metric) - b.total(metric)


def test_merge_metadata_availability_and_metric_sets() -> None:
    cpu_only = snap_of([((FRAMES[0],), "cpu_samples", 3)], {"pid": 1, "host": "a"}, {"gpu_time_ns"})
    gpu = snap_of([((FRAMES[0], FRAMES[4]), "gpu_time_ns", 9)], {"pid": 2, "host": "a"})
    merged = merge(cpu_only, gpu)
    assert merged.meta == {"host": "a"}
    assert "gpu_time_ns" not in merged.unavailable  # one side measured it
    assert "gpu_time_ns" in diff(cpu_only, gpu).unavailable  # a difference needs both
    other = snap_of([((FRAMES[1],), "bytes_seen", 5)], metrics=("bytes_seen", "cpu_samples"))
    both = merge(gpu, other)
    assert both.metrics == METRICS + ("bytes_seen",)
    assert both.total("bytes_seen") == 5 and both.total("gpu_time_ns") == 9
    assert "bytes_seen" not in both.unavailable and "alloc_bytes" not in both.unavailable
    folded = CCT(max_nodes=2)
    folded.add((FRAMES[0], FRAMES[1]), "cpu_samples", 1)
    assert merge(folded.snapshot(), folded.snapshot()).folded_nodes == 2 * folded.folded_nodes > 0


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


times = st.lists(st.floats(0, 30, allow_nan=False), min_size=1, max_size=40).map(sorted)


@given(events, times, st.data())
def test_cumulative_window_diffs_add_up(evs, ts, data) -> None:
    evs = evs[: len(ts)]
    ts = ts[: len(evs)]
    w = WindowedCCT(bucket_s=1.0, horizon_s=10.0, max_nodes=None)
    cut = data.draw(st.integers(0, len(evs)))
    for (path, metric, value), t in zip(evs[:cut], ts[:cut]):
        w.add(path, metric, value, now=t)
    t1 = ts[cut - 1] if cut else 0.0
    early = w.snapshot(now=t1)
    for (path, metric, value), t in zip(evs[cut:], ts[cut:]):
        w.add(path, metric, value, now=t)
    late = w.snapshot(now=ts[-1] if ts else 0.0)
    assert values(diff(late, early)) == values(snap_of(evs[cut:]))
    assert values(late) == values(snap_of(evs))
    assert diff(late, early) == merge(diff(late, early), snap_of([]))


@given(events, times, st.floats(0.5, 10), st.sampled_from([0.25, 1.0, 2.5]))
def test_sliding_window_holds_the_last_buckets(evs, ts, window_s, bucket_s) -> None:
    evs = evs[: len(ts)]
    ts = ts[: len(evs)]
    clock = Clock()
    w = WindowedCCT(bucket_s=bucket_s, horizon_s=10.0, max_nodes=None, clock=clock)
    for (path, metric, value), t in zip(evs, ts):
        clock.t = t
        w.add(path, metric, value)
    now = (ts[-1] if ts else 0.0) + 0.1
    clock.t = now
    window_s = min(window_s, 10.0)
    newest = math.floor(now / bucket_s)
    oldest = newest - math.ceil(window_s / bucket_s - 1e-9) + 1
    inside = [e for e, t in zip(evs, ts) if math.floor(t / bucket_s) >= oldest]
    assert values(w.snapshot(window_s)) == values(snap_of(inside))
    assert values(w.snapshot()) == values(snap_of(evs))


def test_window_expires_buckets_and_bounds_memory() -> None:
    w = WindowedCCT(bucket_s=1.0, horizon_s=5.0)
    for second in range(100):
        w.add((FRAMES[0], Frame.op(f"op{second}")), "cpu_samples", 1, now=float(second))
    assert len(w._closed) <= 5
    recent = w.snapshot(3.0, now=99.5)
    assert recent.total("cpu_samples") == 3
    assert {recent.path(n)[-1].name for n in recent.top("cpu_samples", 10)} == {"op97", "op98", "op99"}
    assert w.snapshot(now=99.5).total("cpu_samples") == 100
    assert w.snapshot(5.0, now=200.0).total("cpu_samples") == 0  # idle: every bucket expired
    assert len(w._closed) == 0
    with pytest.raises(ValueError):
        w.snapshot(6.0)


def test_late_events_count_in_the_open_bucket() -> None:
    w = WindowedCCT(bucket_s=1.0, horizon_s=10.0)
    w.add((FRAMES[0],), "cpu_samples", 1, now=5.5)
    w.add((FRAMES[0],), "cpu_samples", 1, now=4.9)  # another CPU's ring buffer, a bit behind
    assert w.snapshot(1.0, now=5.6).total("cpu_samples") == 2


def test_window_views_respect_the_node_cap() -> None:
    w = WindowedCCT(bucket_s=1.0, horizon_s=60.0, max_nodes=20)
    for second in range(30):
        for i in range(10):
            w.add((Frame.op(f"s{second}"), Frame.kernel(f"k{i}")), "gpu_time_ns", 10, now=float(second))
    for snap in (w.snapshot(now=29.5), w.snapshot(30.0, now=29.5)):
        assert snap.node_count <= 20
        assert snap.total("gpu_time_ns") == 3000
        assert snap.folded_nodes > 0


def test_meta_and_unavailable_pass_through() -> None:
    w = WindowedCCT()
    w.add((FRAMES[0],), "cpu_samples", 1)
    snap = w.snapshot(meta={"pid": 7}, unavailable={"gpu_time_ns"})
    assert snap.meta == {"pid": 7} and snap.unavailable == {"gpu_time_ns"}


def test_a_window_says_the_seconds_it_covers() -> None:
    """To a bucket, from the oldest bucket's start; a tree younger than the window from its first
    event (rates and shares divide by it: analyzer/view.py reads meta window_s)."""
    w = WindowedCCT(bucket_s=1.0, horizon_s=60.0)
    w.add((FRAMES[0],), "cpu_samples", 1, now=100.25)
    assert w.snapshot(10.0, now=103.5).meta["window_s"] == pytest.approx(3.25)   # young: since 100.25
    w.add((FRAMES[0],), "cpu_samples", 1, now=115.0)
    assert w.snapshot(10.0, now=115.5).meta["window_s"] == pytest.approx(9.5)    # buckets 106..115
    assert "window_s" not in w.snapshot(now=115.5).meta                          # cumulative
