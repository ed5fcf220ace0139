"""splice(): Python frames, eval-loop native frames and operators joined into one path."""

from __future__ import annotations

from stacklens.cct import Frame
from stacklens.daemon.join.joiner import Joiner
from stacklens.daemon.join.splice import MAX_NATIVE_FRAMES, splice
from stacklens.records.events import make_event

PY = "libpython3.11.so.1.0"
N = Frame.native
TRUNC = Frame.other("[truncated]")
step = Frame.python("train.py", "step", 42)
fwd = Frame.python("model.py", "forward", 17)
START = (N("python3.11", "_start"), N(PY, "Py_RunMain"))


def test_python_then_extension_then_operators_then_native():
    native = START + (N(PY, "_PyEval_EvalFrameDefault"), N(PY, "cfunction_call"),
                      N("libtorch_python.so", "THPVariable_linear"),
                      N("libtorch_cpu.so", "at::_ops::linear::call"), N("libtorch_cpu.so", "at::native::addmm"))
    got = splice((step, fwd), (True, False), ("aten::linear", "aten::addmm"), native)
    assert [f.label() for f in got] == [
        "py:train.py:step:42", "py:model.py:forward:17", "native:libtorch_python.so:THPVariable_linear",
        "op:aten::linear", "op:aten::addmm", "native:libtorch_cpu.so:at::_ops::linear::call",
        "native:libtorch_cpu.so:at::native::addmm"]


def test_c_calling_back_into_python_is_spliced_between_runs():
    mod, sorter, cmp = (Frame.python("t.py", n, i) for n, i in (("<module>", 1), ("sorter", 5), ("cmp", 9)))
    native = START + (N(PY, "_PyEval_EvalFrameDefault"), N(PY, "cfunction_call"), N("libc.so.6", "qsort"),
                      N("_ctypes.so", "closure_fcn"), N(PY, "PyObject_Call"),
                      N(PY, "_PyEval_EvalFrameDefault.cold"), N("libc.so.6", "getpid"))
    got = splice((mod, sorter, cmp), (True, False, True), (), native)
    assert got == (mod, sorter, N("libc.so.6", "qsort"), N("_ctypes.so", "closure_fcn"), cmp, N("libc.so.6", "getpid"))


def test_eval_frames_not_matching_the_runs_leave_python_above():
    # the unwind lost an eval frame: no guessing between runs, leaf part still below
    a, b = Frame.python("t.py", "a", 1), Frame.python("t.py", "b", 2)
    native = (TRUNC, N("libc.so.6", "qsort"), N(PY, "PyObject_Call"), N(PY, "_PyEval_EvalFrameDefault"),
              N("libfakeapp.so", "app_forward_launches"))
    got = splice((a, b), (True, True), (), native)
    assert got == (a, b, N("libfakeapp.so", "app_forward_launches"))


def test_no_markers_is_the_classic_concatenation():
    native = (TRUNC, N("libtorch_cpu.so", "at::native::addmm"))
    got = splice((step,), (), ("aten::addmm",), native)
    assert got == (step, Frame.op("aten::addmm"), TRUNC, N("libtorch_cpu.so", "at::native::addmm"))


def test_leaf_most_native_frames_kept_and_cut_marked():
    leafs = tuple(N("libx.so", f"f{i}") for i in range(40))
    got = splice((step,), (True,), (), START + (N(PY, "_PyEval_EvalFrameDefault"),) + leafs)
    assert got[0] == step and got[1] == TRUNC and got[2:] == leafs[-MAX_NATIVE_FRAMES:]


def test_joiner_uses_entries_and_memoizes():
    native = START + (N(PY, "_PyEval_EvalFrameDefault"), N("libtorch_python.so", "THPVariable_linear"),
                      N("libtorch_cpu.so", "at::_ops::linear::call"))
    j = Joiner(1)
    ev = make_event("cpu_sample", "", 1, 1, 0, 0, {}, ("aten::linear",), native, (step, fwd),
                    py_entries=(True, False))
    for _ in range(3):
        j.on_bpf(ev)
    snap = j.snapshot()
    n = snap.find(["py:train.py:step:42", "py:model.py:forward:17", "native:libtorch_python.so:THPVariable_linear",
                   "op:aten::linear", "native:libtorch_cpu.so:at::_ops::linear::call"])
    assert n is not None and snap.inclusive(n, "cpu_samples") == 3


ANON, VDSO = Frame.other("[anon]"), Frame.other("[vdso]")
mod, f, g = (Frame.python("main.py", n, i) for n, i in (("main", 3), ("f", 7), ("g", 11)))


def test_a_statically_linked_interpreter_is_spliced_like_libpython():
    """Debian/Ubuntu system Pythons are one executable: the Symbolizer names its frames by the
    file's basename, "python3.12" — interpreter frames as much as libpython's are."""
    S = "python3.12"
    native = (N(S, "_start"), N(S, "Py_RunMain"), N(S, "_PyEval_EvalFrameDefault"), N(S, "cfunction_call"),
              N("libc.so.6", "qsort"), N("_ctypes.cpython-312-x86_64-linux-gnu.so", "closure_fcn"),
              N(S, "PyObject_Call"), N(S, "_PyEval_EvalFrameDefault"), N("libc.so.6", "getpid"))
    got = splice((mod, f), (True, True), (), native)
    assert got == (mod, N("libc.so.6", "qsort"), N("_ctypes.cpython-312-x86_64-linux-gnu.so", "closure_fcn"),
                   f, N("libc.so.6", "getpid"))


def test_perf_trampolines_between_eval_frames_are_dropped():
    """Under `python -X perf` (3.12+) every eval-loop invocation is entered through a trampoline in
    anonymous memory: `[anon]` frames among the interpreter's, which the Python frames stand for."""
    for interp in (PY, "python3.12"):
        native = (N("python3.12", "_start"), N(interp, "Py_RunMain"), N(interp, "py_trampoline_evaluator"), ANON,
                  N(interp, "_PyEval_EvalFrameDefault"), N(interp, "_PyEval_Vector"),
                  N(interp, "py_trampoline_evaluator"), ANON,
                  N(interp, "_PyEval_EvalFrameDefault"), ANON,   # no interpreter frame between: still its own
                  N(interp, "_PyEval_EvalFrameDefault"), N("libc.so.6", "getpid"))
        got = splice((mod, f, g), (True, True, True), (), native)
        assert got == (mod, f, g, N("libc.so.6", "getpid")), interp


def test_jit_code_a_c_function_calls_stays_between_runs():
    native = (N(PY, "_PyEval_EvalFrameDefault"), N(PY, "cfunction_call"), N("libjit.so", "run"), ANON,
              N("libjit.so", "callback"), N(PY, "PyObject_Call"), N(PY, "py_trampoline_evaluator"), ANON,
              N(PY, "_PyEval_EvalFrameDefault"))
    got = splice((mod, f), (True, True), (), native)
    assert got == (mod, N("libjit.so", "run"), ANON, N("libjit.so", "callback"), f)


def test_a_vdso_or_jit_leaf_below_the_last_python_frame_is_kept():
    """A CPU sample in clock_gettime's vDSO ends in `[vdso]`; one in JIT code in `[anon]`."""
    for interp in (PY, "python3.12"):
        native = (N(interp, "_PyEval_EvalFrameDefault"), N(interp, "py_trampoline_evaluator"), ANON,
                  N(interp, "_PyEval_EvalFrameDefault"), N(interp, "time_time"),
                  N("libc.so.6", "clock_gettime"), VDSO)
        assert splice((mod, f), (True, True), (), native) == (mod, f, N("libc.so.6", "clock_gettime"), VDSO)
        native = native[:5] + (VDSO,)        # the vDSO without a frame pointer hides libc's frame
        assert splice((mod, f), (True, True), (), native) == (mod, f, VDSO)
        native = native[:2] + (ANON,)        # a sample in the trampoline itself
        assert splice((mod,), (True,), (), native) == (mod, ANON)
