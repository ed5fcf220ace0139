"""Samples by thread (issue 22, pprof's thread labels): a bounded breakdown per node whose rest is
"[other threads]", carried through folds, merges, windows, JSON and the columnar form; the join
counts BPF and agent samples by their tid and names each thread once."""

from __future__ import annotations

import gc
import gzip
import json
import tracemalloc

import pytest

from stacklens.cct import CCT, Frame, WindowedCCT, diff, merge
from stacklens.cct.export import decode_profile, encode_profile, from_json, load, save, to_json
from stacklens.cct.metrics import ALL
from stacklens.cct.tree import MAX_THREADS
from stacklens.daemon.join.joiner import Joiner
from stacklens.errors import InputError
from stacklens.records.agent import PySample
from tests.fakes.sources import FakeEvent, py

MAIN = (Frame.python("/app/train.py", "main", 3),)
LOAD = MAIN + (Frame.python("/app/train.py", "load", 9),)
STEP = MAIN + (Frame.python("/app/train.py", "step", 20),)


def node(snap, path) -> int:
    n = snap.find([f.label() for f in path])
    assert n is not None
    return n


def sampled() -> CCT:
    tree = CCT(ALL)
    tree.add_sample(LOAD, "cpu_samples", 101, 5)
    tree.add_sample(LOAD, "cpu_samples", 102, 2)
    tree.add_sample(STEP, "cpu_samples", 100, 7)
    tree.add_sample(STEP, "py_samples", 100, 3)
    tree.add_sample(STEP, "cpu_samples", 0, 4)      # no thread known: counted, not listed
    tree.add(STEP, "gpu_time_ns", 900)
    return tree


def test_values_are_counted_by_thread_and_the_rest_is_other_threads() -> None:
    snap = sampled().snapshot()
    assert snap.threads(node(snap, LOAD), "cpu_samples") == ((101, 5), (102, 2))
    step = node(snap, STEP)
    assert snap.threads(step, "cpu_samples") == ((100, 7),) and snap.exclusive(step, "cpu_samples") == 11
    assert snap.threads(step, "py_samples") == ((100, 3),) and snap.threads(step, "gpu_time_ns") == ()
    assert snap.threaded == {"cpu_samples", "py_samples"}

    tree = CCT()
    for tid in range(1, MAX_THREADS + 5):
        tree.add_sample(LOAD, "cpu_samples", tid, tid)
    snap = tree.snapshot()
    listed = snap.threads(node(snap, LOAD), "cpu_samples")
    assert sorted(t for t, _ in listed) == list(range(1, MAX_THREADS + 1))   # the first ones seen
    assert snap.total("cpu_samples") == sum(range(1, MAX_THREADS + 5))        # the rest: in the value


def test_folds_merges_and_windows_carry_the_counts() -> None:
    tree = CCT(max_nodes=6)
    tree.add_sample(STEP, "cpu_samples", 100, 1000)
    for i in range(30):                      # cold contexts folded into [other], counts with them
        tree.add_sample(MAIN + (Frame.python("/app/x.py", f"f{i}", i),), "cpu_samples", 7, 1)
    snap = tree.snapshot()
    assert snap.folded_nodes and snap.total("cpu_samples") == 1030
    by_tid: dict[int, int] = {}
    for n in range(snap.node_count):
        for tid, count in snap.threads(n, "cpu_samples"):
            by_tid[tid] = by_tid.get(tid, 0) + count
    assert by_tid == {100: 1000, 7: 30}

    one = sampled().snapshot()
    two = merge(one, one)
    assert two.threads(node(two, LOAD), "cpu_samples") == ((101, 10), (102, 4))
    assert diff(two, one) == one and diff(one, one).threaded == frozenset()

    t = [0.0]
    w = WindowedCCT(ALL, clock=lambda: t[0])
    w.add_sample(LOAD, "cpu_samples", 101)
    t[0] = 1.5
    w.add_sample(LOAD, "cpu_samples", 101)
    for snap in (w.snapshot(), w.snapshot(window_s=2.0)):
        assert snap.threads(node(snap, LOAD), "cpu_samples") == ((101, 2),)


def test_json_and_columnar_keep_the_breakdown_and_old_files_still_load(tmp_path) -> None:
    snap = sampled().snapshot(meta={"pid": 4, "threads": {"100": "main", "101": "loader"}})
    path = tmp_path / "p.json.gz"
    save(snap, path)
    assert load(path) == snap and decode_profile(encode_profile(snap)) == snap
    back = decode_profile(encode_profile(snap))
    assert back.threads(node(back, LOAD), "cpu_samples") == ((101, 5), (102, 2))
    obj = to_json(snap)
    assert obj["version"] == 1 and obj["threads"]["cpu_samples"]
    old = {k: v for k, v in obj.items() if k != "threads"}     # a file from before the breakdown
    assert from_json(old).threaded == frozenset() and from_json(old).total("cpu_samples") == 18
    json.dumps(obj)
    for bad in ({"gpu_watts": []}, {"cpu_samples": [[99, 1, 1]]}, {"cpu_samples": [[1, 0, 1]]},
                {"cpu_samples": [[1, 2]]}, []):
        with pytest.raises(InputError, match="threads"):
            from_json({**obj, "threads": bad})
    assert gzip.decompress(path.read_bytes())


def test_the_estimate_counts_the_breakdown() -> None:
    gc.collect()
    tracemalloc.start()
    try:
        tree = CCT(max_nodes=None)
        paths = [MAIN + (Frame.python("/app/m.py", f"f{i}", i),) for i in range(4000)]
        for p in paths:
            tree.add(p, "cpu_samples", 1)
        before = tree.estimated_bytes
        base = tracemalloc.get_traced_memory()[0]
        for p in paths:
            for tid in range(1000, 1000 + MAX_THREADS):
                tree.add_sample(p, "cpu_samples", tid)
        used = tracemalloc.get_traced_memory()[0] - base
    finally:
        tracemalloc.stop()
    assert 0.9 <= (tree.estimated_bytes - before) / used <= 1.6, (tree.estimated_bytes - before, used)


def test_the_join_counts_samples_by_tid_and_names_each_thread_once() -> None:
    asked: list[int] = []

    def name(tid: int) -> str:
        asked.append(tid)
        return {11: "main", 12: "loader"}.get(tid, "")

    j = Joiner(1, agent=True, thread_name=name)
    stack = (py("main", 10), py("step", 20))
    for tid in (11, 11, 12, 13):
        j.on_bpf(FakeEvent(kind="cpu_sample", tid=tid, py_stack=stack))
    j.on_agent(PySample(tid=12, t_ns=0, frames=(("train.py", "main", 10),)))
    snap = j.snapshot()
    assert asked == [11, 12, 13]
    assert snap.meta["threads"] == {"11": "main", "12": "loader"}
    n = snap.find(["py:train.py:main:10", "py:train.py:step:20"])
    assert snap.threads(n, "cpu_samples") == ((11, 2), (12, 1), (13, 1))
    assert snap.threads(snap.find(["py:train.py:main:10"]), "py_samples") == ((12, 1),)
