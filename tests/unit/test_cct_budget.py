"""The byte budget of a tree and of a windowed tree (issue 17): frame strings count, the estimate
agrees with what Python allocates, and a flood of unique contexts stays within the budget with
what it cost counted."""

from __future__ import annotations

import gc
import tracemalloc

import pytest

from stacklens.cct import Frame
from stacklens.cct.tree import CCT
from stacklens.cct.window import DEFAULT_MAX_BYTES, WindowedCCT

METRICS = ("cpu_samples", "py_samples", "gpu_time_ns")


def unique_path(i: int, strlen: int, depth: int = 4) -> tuple[Frame, ...]:
    return tuple(Frame.python(f"/f{i}_{d}".ljust(strlen, "x"), f"fn{i}_{d}".ljust(strlen // 2, "y"), d)
                 for d in range(depth))


@pytest.mark.parametrize("strlen, n", [(1024, 1500), (24, 15000)])
def test_estimate_agrees_with_tracemalloc(strlen, n) -> None:
    gc.collect()
    tracemalloc.start()
    try:
        tree = CCT(METRICS, max_nodes=None)
        base = tracemalloc.get_traced_memory()[0]
        for i in range(n):
            tree.add_many(unique_path(i, strlen), {"py_samples": 1000 + i})
        used = tracemalloc.get_traced_memory()[0] - base
    finally:
        tracemalloc.stop()
    # errs high (shared objects are counted in every tree), never far below what is held
    assert 0.9 <= tree.estimated_bytes / used <= 1.6, (tree.estimated_bytes, used)


def test_byte_cap_folds_and_conserves_totals() -> None:
    cap = 2 << 20
    tree = CCT(METRICS, max_nodes=None, max_bytes=cap)
    hot = (Frame.python("/app/train.py", "step", 10),)
    tree.add_many(hot, {"cpu_samples": 10_000})
    for i in range(3000):              # ~7 MiB of unique 1 KiB frames
        tree.add_many(unique_path(i, 1024), {"cpu_samples": 1})
        assert tree.estimated_bytes <= cap
    snap = tree.snapshot()
    assert snap.total("cpu_samples") == 10_000 + 3000
    assert tree.budget_folded > 0 and snap.folded_nodes >= tree.budget_folded
    # the hot context survives the folds: coldest go first
    assert snap.find([hot[0].label()]) is not None


def test_window_flood_stays_within_budget_and_says_so() -> None:
    t = [0.0]
    budget = 12 << 20
    w = WindowedCCT(METRICS, bucket_s=1.0, horizon_s=120.0, clock=lambda: t[0], max_bytes=budget)
    n = 0
    for second in range(40):           # 40 buckets of ~2.7 MiB of new contexts: 108 MiB unbounded
        t[0] = float(second)
        for _ in range(300):
            w.add(unique_path(n, 1024, depth=2), "py_samples", 1)
            n += 1
        assert w.memory()["used_bytes"] <= budget
    mem = w.memory()
    assert mem["evicted_buckets"] > 0 and mem["budget_folded_nodes"] > 0, mem
    snap = w.snapshot()
    assert snap.total("py_samples") == n          # nothing lost, only context
    assert snap.meta["memory"]["evicted_buckets"] == mem["evicted_buckets"]
    # window views reach back as far as the budget kept: fewer samples than asked, none invented
    assert 0 < w.snapshot(window_s=120.0).total("py_samples") < n


def test_ordinary_profile_is_untouched_by_the_default_budget() -> None:
    t = [0.0]
    w = WindowedCCT(METRICS, clock=lambda: t[0])
    assert w.max_bytes == DEFAULT_MAX_BYTES == 192 << 20
    # 2,000 distinct 31-frame stacks over 40 callers (each second sees 300 of them, 3,300 nodes)
    prefixes = [tuple(Frame.python(f"/site-packages/pkg/mod{d}.py", f"fn{d}_{k}", d) for d in range(30))
                for k in range(40)]
    stacks = [prefixes[k % 40] + (Frame.python("/app/leaf.py", f"leaf{k}", k),) for k in range(2000)]
    for second in range(120):
        t[0] = float(second)
        for i in range(300):
            w.add(stacks[(second * 300 + i) % 2000], "cpu_samples", 1)
    snap = w.snapshot(meta={"pid": 7})
    assert snap.meta == {"pid": 7}                 # nothing dropped, nothing to say
    mem = w.memory()    # ~100 MB estimated (shared frames counted in every bucket), nothing dropped
    assert mem["used_bytes"] < DEFAULT_MAX_BYTES and mem["evicted_buckets"] == mem["budget_folded_nodes"] == 0
    assert w.snapshot(window_s=120.0).total("cpu_samples") == 120 * 300
