"""Launches counted on `kernel:unresolved:0x…` before the kernel's name was learnt, moved onto the
named kernel in snapshots (daemon/join/rename.py, issue 29)."""

from __future__ import annotations

from pathlib import Path

import pytest

from stacklens.cct import CCT, Frame
from stacklens.cct.export import load
from stacklens.cct.tree import MAX_THREADS
from stacklens.daemon.join.joiner import Joiner
from stacklens.daemon.join.rename import META_KEY, name_launches
from tests.fakes.sources import FakeEvent, py

METRICS = ("gpu_time_ns", "kernel_count", "launch_count", "cpu_samples")
A = (Frame.python("train.py", "step", 20), Frame.op("aten::mm"), Frame.api("cuLaunchKernel"))
B = (Frame.python("train.py", "eval", 40), Frame.api("cuLaunchKernel"))
K = Frame.kernel("gemm_kernel")
X, Y = Frame.native("helper", "libx.so"), Frame.native("other", "libx.so")
H1, H2 = "unresolved:0x1", "unresolved:0x2"
DATA = Path(__file__).resolve().parents[1] / "data" / "gpu_run31"


def _totals(snap) -> dict[str, int]:
    return {m: snap.total(m) for m in snap.metrics}


def _unresolved(snap) -> list[int]:
    return [i for i in range(snap.node_count)
            if snap.frame_of(i).kind == "kernel" and snap.frame_of(i).name.startswith("unresolved:")]


def _tree() -> CCT:
    t = CCT(METRICS)
    t.add_many(A + (K,), {"gpu_time_ns": 100, "kernel_count": 1, "launch_count": 2})
    t.add_many(A + (K, X), {"launch_count": 1})
    t.add_sample(A + (K, X), "cpu_samples", tid=7, value=2)
    t.add_many(A + (Frame.kernel(H1),), {"launch_count": 3})
    t.add_many(A + (Frame.kernel(H1), X), {"launch_count": 5})
    t.add_sample(A + (Frame.kernel(H1), X), "cpu_samples", tid=7, value=3)
    t.add_sample(A + (Frame.kernel(H1), X), "cpu_samples", tid=8, value=1)
    t.add_many(A + (Frame.kernel(H1), Y), {"launch_count": 7})
    t.add_many(A + (Frame.kernel(H2),), {"launch_count": 11})       # never named
    t.add_many(B + (Frame.kernel(H1),), {"launch_count": 13})       # no named sibling: renamed alone
    return t


def test_a_named_handle_merges_into_its_sibling_and_a_never_named_one_is_counted_once():
    before = _tree().snapshot(meta={"notes": ["agent: injected"]})
    snap = name_launches(before, {H1: "gemm_kernel", "unresolved:0x9": "elsewhere"})
    assert _totals(snap) == _totals(before)                         # nothing lost, nothing doubled
    labels = [f.label() for f in A]
    k = snap.find(labels + ["kernel:gemm_kernel"])
    assert (snap.exclusive(k, "launch_count"), snap.exclusive(k, "gpu_time_ns"), snap.exclusive(k, "kernel_count")) \
        == (2 + 3, 100, 1)
    x = snap.find(labels + ["kernel:gemm_kernel", X.label()])       # children merged too
    assert snap.exclusive(x, "launch_count") == 1 + 5 and snap.exclusive(x, "cpu_samples") == 2 + 4
    assert dict(snap.threads(x, "cpu_samples")) == {7: 5, 8: 1}
    assert snap.exclusive(snap.find(labels + ["kernel:gemm_kernel", Y.label()]), "launch_count") == 7
    assert len(snap.children(snap.find(labels))) == 2               # gemm_kernel and the unnamed handle
    assert snap.exclusive(snap.find([f.label() for f in B] + ["kernel:gemm_kernel"]), "launch_count") == 13
    (left,) = _unresolved(snap)
    assert snap.frame_of(left).name == H2 and snap.exclusive(left, "launch_count") == 11
    notes = [n for n in snap.meta["notes"] if "carry no kernel name" in n]
    assert notes == [notes[0]] and notes[0].startswith("11 kernel launches carry no kernel name")
    assert snap.meta["notes"][0] == "agent: injected"
    assert snap.meta[META_KEY] == {"renamed": {H1: "gemm_kernel"}, "unnamed_launches": 11}
    # the tree numbering a Snapshot relies on: parents before children, one child per frame
    for n in range(1, snap.node_count):
        assert snap.parent(n) < n
    for n in range(snap.node_count):
        kids = [snap.frame_of(c) for c in snap.children(n)]
        assert len(kids) == len(set(kids))


def test_nothing_unresolved_is_the_same_snapshot():
    t = CCT(METRICS)
    t.add_many(A + (K,), {"launch_count": 2})
    snap = t.snapshot()
    assert name_launches(snap, {H1: "gemm_kernel"}) is snap


def test_only_unnamed_handles_keep_the_tree_and_say_so_once():
    t = CCT(METRICS)
    t.add_many(A + (Frame.kernel(H2),), {"launch_count": 4})
    t.add_many(B + (Frame.kernel(H1),), {"launch_count": 6})
    snap = name_launches(t.snapshot(), {})
    assert len(_unresolved(snap)) == 2
    (note,) = snap.meta["notes"]
    assert note.startswith("10 kernel launches carry no kernel name")
    assert snap.meta[META_KEY] == {"renamed": {}, "unnamed_launches": 10}
    again = name_launches(snap, {H1: "gemm_kernel"})                 # a second pass: still one note
    assert [x for x in again.meta["notes"] if "carry no kernel name" in x] == [
        "4 kernel launches carry no kernel name (kernel:unresolved:0x…, the driver's function handle): their "
        "module was loaded before stacklens attached and no GPU record has named the kernel"]
    assert len(_unresolved(again)) == 1 and again.total("launch_count") == 10


def test_merged_thread_counts_keep_the_cap_of_the_tree():
    t = CCT(METRICS)
    for tid in range(1, MAX_THREADS + 1):
        t.add_sample(A + (K,), "cpu_samples", tid=tid, value=tid)
        t.add_sample(A + (Frame.kernel(H1),), "cpu_samples", tid=100 + tid, value=100 + tid)
    snap = name_launches(t.snapshot(), {H1: K.name})
    k = snap.find([f.label() for f in A] + [K.label()])
    threads = snap.threads(k, "cpu_samples")
    assert [tid for tid, _ in threads] == list(range(100 + MAX_THREADS, 100, -1))   # the largest kept
    assert snap.exclusive(k, "cpu_samples") == sum(range(1, MAX_THREADS + 1)) + sum(range(101, 101 + MAX_THREADS))


def _launch(t, kernel):
    return FakeEvent(kind="launch", tid=1, ktime_ns=t, api="cuLaunchKernel", op_path=("aten::add",),
                     py_stack=(py("main", 10),), kernel_name=kernel)


def test_the_joiner_says_once_per_snapshot_how_many_launches_have_no_name():
    """Without an agent no GPU record ever names a handle: the launches stay on the handle's node,
    one note per snapshot (the Joiner's own notes are not touched)."""
    j = Joiner(1, agent=False)
    for i in range(3):
        j.on_bpf(_launch(100 + i, H1))
    for _ in range(2):
        snap = j.snapshot()
        assert [n for n in snap.meta.get("notes", ()) if "carry no kernel name" in n] == [
            "3 kernel launches carry no kernel name (kernel:unresolved:0x…, the driver's function handle): their "
            "module was loaded before stacklens attached and no GPU record has named the kernel"]
        assert len(_unresolved(snap)) == 1
    assert "notes" not in j.meta


@pytest.mark.parametrize("name", ["decode", "eager_train"])
def test_recorded_h200_profiles_lose_every_unresolved_node_whose_handle_is_named(name):
    """The run-31 profiles (taken before this rename): each handle named as the kernel beside it,
    where that is one kernel (what the join would have learnt), every metric's total kept."""
    snap = load(DATA / f"{name}.json.gz")
    names: dict[str, str] = {}
    unresolved = set(_unresolved(snap))
    for i in unresolved:
        beside = {snap.frame_of(c).name for c in snap.children(snap.parent(i))
                  if snap.frame_of(c).kind == "kernel" and c not in unresolved}
        if len(beside) == 1:
            names[snap.frame_of(i).name] = beside.pop()
    unnamed = sum(snap.exclusive(i, "launch_count") for i in unresolved if snap.frame_of(i).name not in names)
    out = name_launches(snap, names)
    assert _totals(out) == _totals(snap)
    assert all(out.frame_of(i).name not in names for i in _unresolved(out))
    assert out.node_count == snap.node_count - (len(unresolved) - len(_unresolved(out)))   # each into its sibling
    assert out.meta[META_KEY]["unnamed_launches"] == unnamed
    assert sum(out.exclusive(i, "launch_count") for i in _unresolved(out)) == unnamed
