"""sync_stalls without view ops in the op paths.

The default op probe set skips view and metadata ops (stacklens.bpf.ops.VIEW_OPS), so the
`probs[i]` of a per-element `.item()` loop has no `aten::select_int`/`aten::as_strided` op frame:
its samples read py line → C extension → native `at::_ops::select_int::call` → … The rule must
charge the same CPU to the line with and without those op frames.
"""

from __future__ import annotations

import pathlib

from stacklens.analyzer import analyze
from stacklens.bpf.ops import VIEW_OPS
from stacklens.cct import CCT, METRICS, Frame
from stacklens.cct.export import load

DATA = pathlib.Path(__file__).resolve().parents[1] / "data"
S = "tests/targets/scenario_item_sync.py"
LINE = "py:" + S + ":step:29"
TORCH = "libtorch_cpu.so"
GLUE = Frame.native("libtorch_python.so", "torch::autograd::THPVariable_getitem(_object*, _object*)")
SELECT = Frame.native(TORCH, "at::_ops::select_int::call(at::Tensor const&, long, c10::SymInt)")
STRIDED = Frame.native(TORCH, "at::_ops::as_strided::call(at::Tensor const&, c10::ArrayRef<c10::SymInt>, "
                              "c10::ArrayRef<c10::SymInt>, std::optional<c10::SymInt>)")
META = {"duration_s": 1.0, "cpu_hz": 1000}


def _item_loop(view_ops_probed: bool, python: bool = True) -> CCT:
    """1000 CPU samples: 300 in item, 200 picking elements, 20 in the C extension at the loop's
    line; 480 in a matmul on another line (not part of the finding)."""
    t = CCT(METRICS)
    main = (Frame.python(S, "<module>", 36),) if python else ()
    loop = main + (Frame.python(S, "step", 29),) if python else ()
    other = main + (Frame.python(S, "step", 21),) if python else ()
    t.add(loop + (Frame.op("aten::item"), Frame.op("aten::_local_scalar_dense")), "cpu_samples", 300)
    t.add(loop + (GLUE,), "cpu_samples", 20)
    ops = (Frame.op("aten::select_int"),) if view_ops_probed else ()
    t.add(loop + (GLUE,) + ops + (SELECT,), "cpu_samples", 100)
    ops += (Frame.op("aten::as_strided"),) if view_ops_probed else ()
    t.add(loop + (GLUE,) + ops + (SELECT, STRIDED), "cpu_samples", 80)
    t.add(other + (Frame.op("aten::matmul"), Frame.op("aten::mm"), Frame.native(TORCH, "sgemm")), "cpu_samples", 480)
    return t


def _sync(snap):
    return [f for f in analyze(snap) if f.rule == "sync_stalls"]


def test_same_cost_with_and_without_view_op_frames():
    found = {}
    for probed in (True, False):
        fs = _sync(_item_loop(probed).snapshot(META))
        assert len(fs) == 1, fs
        assert LINE in fs[0].path
        found[probed] = fs[0]
    # item 300 + element picking 180 + the extension's glue 20: not the other line's matmul
    assert found[True].evidence["cpu_samples"] == found[False].evidence["cpu_samples"] == 500
    assert found[True].severity == found[False].severity == "high"


def test_without_python_frames_only_element_picking_counts():
    # No Python line (line 0 is the whole process): the matmul and the extension's glue are not
    # charged; the native at::_ops::select_int::call frames are, as the op frames were.
    for probed in (True, False):
        fs = _sync(_item_loop(probed, python=False).snapshot(META))
        assert len(fs) == 1
        assert fs[0].path[-1] == "op:aten::item"
        assert fs[0].evidence["cpu_samples"] == 300 + 180


def _strip_view_ops(snap):
    """The recording as the default probe set would have made it: VIEW_OPS op frames removed."""
    t = CCT(snap.metrics, max_nodes=None)
    for i in range(1, snap.node_count):
        vals = {m: snap.exclusive(i, m) for m in snap.metrics if snap.exclusive(i, m)}
        if vals:
            t.add_many(tuple(f for f in snap.path(i) if not (f.kind == "op" and f.name in VIEW_OPS)), vals)
    return t.snapshot(snap.meta, snap.unavailable)


def test_recorded_item_sync_without_view_ops():
    # tests/data/bpf_item_sync was recorded with every op probed (select_int, as_strided in paths)
    problem = load(DATA / "bpf_item_sync" / "problem.json")
    stripped = _strip_view_ops(problem)
    assert not any(f.kind == "op" and f.name in VIEW_OPS for i in range(stripped.node_count)
                   for f in [stripped.frame_of(i)])
    before, after = _sync(problem), _sync(stripped)
    assert [f.path[-1] for f in after] == [f.path[-1] for f in before] == ["op:aten::item"]
    assert after[0].severity == "high"
    # native stacks cut (16 leaf-most frames) above `at::_ops::select_int::call` lose their
    # element-picking mark without a Python line: 89 of 111 samples still charged
    assert after[0].evidence["cpu_samples"] >= 0.75 * before[0].evidence["cpu_samples"]
    assert not _sync(_strip_view_ops(load(DATA / "bpf_item_sync" / "fixed.json")))
