"""Where a cut native stack's `[truncated]` marker lands in the joined path (issue 30): right
below the frame the cut happened under — the operator, the Python line, the extension — so the
profile has one marker per parent, never one node that cut stacks of different parents share,
and never a marker between an operator and its leaf when the unwind got from one to the other."""

from __future__ import annotations

from stacklens.bpf.decode import TRUNCATED, native_frames
from stacklens.cct import Frame
from stacklens.daemon.join.splice import MAX_OP_NATIVE_FRAMES, splice

N = Frame.native
CPU, TP, PY = "libtorch_cpu.so", "libtorch_python.so", "libpython3.11.so.1.0"
step = Frame.python("train.py", "step", 42)
ROOT = (N("python3.11", "_start"), N(PY, "Py_RunMain"), N(PY, "_PyEval_EvalFrameDefault"))


def _parent_of_marker(path: tuple[Frame, ...]) -> Frame | None:
    i = path.index(TRUNCATED)
    return path[i - 1] if i else None


def test_cut_stacks_under_different_operators_get_a_marker_each_below_their_operator():
    mm = splice((step,), (True,), ("aten::mm",), (TRUNCATED, N(CPU, "mkl_blas_sgemm")))
    add = splice((step,), (True,), ("aten::add",), (TRUNCATED, N(CPU, "mkl_blas_sgemm")))
    assert _parent_of_marker(mm) == Frame.op("aten::mm")
    assert _parent_of_marker(add) == Frame.op("aten::add")
    assert mm[:mm.index(TRUNCATED) + 1] != add[:add.index(TRUNCATED) + 1]   # two nodes, not one


def test_a_cut_above_the_extension_stays_there_and_the_operator_to_leaf_part_is_unbroken():
    native = (TRUNCATED, N(TP, "THPVariable_mm"), N(CPU, "at::_ops::mm::call"), N(CPU, "at::native::mm"),
              N(CPU, "mkl_blas_sgemm"))
    path = splice((step,), (True,), ("aten::mm",), native)
    assert _parent_of_marker(path) == step
    assert TRUNCATED not in path[path.index(Frame.op("aten::mm")):]


def test_a_whole_walk_has_no_marker():
    native = ROOT + (N(TP, "THPVariable_mm"), N(CPU, "at::_ops::mm::call"), N(CPU, "mkl_blas_sgemm"))
    assert TRUNCATED not in splice((step,), (True,), ("aten::mm",), native)


def test_the_decoder_marks_a_cut_walk_once_at_its_outer_end():
    names = {1: N(CPU, "mkl_blas_sgemm"), 2: N(CPU, "at::_ops::mm::call"), 3: N(CPU, "[no symbol]"),
             4: N(CPU, "[no symbol]")}
    frames, cut = native_frames([1, 2, 3, 4, 99], lambda a: names.get(a, Frame.other("[unknown]")))
    assert cut and frames == (TRUNCATED, N(CPU, "[no symbol]"), N(CPU, "at::_ops::mm::call"), N(CPU, "mkl_blas_sgemm"))


def test_frames_the_join_drops_below_an_operator_leave_one_marker_under_it():
    deep = tuple(N(CPU, f"f{i}") for i in range(MAX_OP_NATIVE_FRAMES + 10))
    path = splice((step,), (True,), ("aten::mm",), (TRUNCATED, N(CPU, "at::_ops::mm::call")) + deep)
    assert path.count(TRUNCATED) == 1 and _parent_of_marker(path) == Frame.op("aten::mm")
    assert path[-MAX_OP_NATIVE_FRAMES:] == deep[-MAX_OP_NATIVE_FRAMES:]
