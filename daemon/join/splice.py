"""Stacks to one path: an event's Python frames, operators and unwound native stack spliced
outermost first (`splice`), native stacks cut below the interpreter (`trim_native`), an agent
sample's frames (`sample_frames`). Pure; used by the join (daemon/join/joiner.py) and the
backward link.
"""

from __future__ import annotations

import functools
import re
from typing import Iterable

from stacklens.cct import Frame

# The interpreter's files as the Symbolizer names native frames (the mapped file's basename):
# a shared libpython ("libpython3.12.so.1.0", "libpython3.13t.so.1.0") or a statically linked
# executable ("python3.12", "python3": Debian/Ubuntu system Pythons; "python"). A full path is
# taken by its basename.
_INTERPRETER_FILE = re.compile(r"^(lib)?python(3(\.\d+)?[a-z]*)?(\.so(\.[\d.]*)?)?$")
MAX_NATIVE_FRAMES = 16
# native frames kept from an operator's entry to the leaf: the dispatcher's layers alone take
# 16-40 between at::_ops::mm::call and MKL's kernel (benchmarks/bench_native_stacks.py)
MAX_OP_NATIVE_FRAMES = 96


def trim_native(frames: Iterable[Frame]) -> tuple[Frame, ...]:
    """Native frames below the interpreter, leaf-most MAX_NATIVE_FRAMES of them.

    Frames of the interpreter itself (and everything above it: _start, Py_RunMain …) are what the
    Python frames already say; a truncated marker is kept so a cut stack is never hidden.
    """
    out: list[Frame] = []
    for f in reversed(tuple(frames)):  # leaf first
        if _is_interp(f):
            break
        out.append(f)
        if len(out) >= MAX_NATIVE_FRAMES:
            out.append(Frame.other("[truncated]"))
            break
    out.reverse()
    return tuple(out)


def sample_frames(frames) -> tuple[Frame, ...]:
    """An agent sample's frames; a module's forward, (file, qualname, line, path, class), is its
    `module` frame (the attribute path and class the sampler read) over its Python frame."""
    out: list[Frame] = []
    for f in frames:
        if len(f) == 5:
            out.append(Frame.module(f[3], f[4]))
        out.append(Frame.python(f[0], f[1], f[2]))
    return tuple(out)


EVAL_LOOP = "_PyEval_EvalFrameDefault"
_OP_LIBS = ("libtorch_cpu", "libtorch_cuda", "libtorch_hip")


def _is_eval(f: Frame) -> bool:
    return f.kind == "native" and (f.name == EVAL_LOOP or f.name.startswith(EVAL_LOOP + "."))


@functools.lru_cache(maxsize=1024)
def _is_interp_file(file: str) -> bool:
    # a mapping whose file was replaced while the process runs (an upgrade) is named "... (deleted)"
    return _INTERPRETER_FILE.match(file.rpartition("/")[2].removesuffix(" (deleted)")) is not None


def _is_interp(f: Frame) -> bool:
    return f.kind == "native" and _is_interp_file(f.file)


def _between_runs(seg: tuple[Frame, ...]) -> list[Frame]:
    """The native frames between two eval-loop frames that go between the two Python runs: not
    the interpreter's own frames, nor an `other` frame (`[anon]`, `[vdso]`) inside the
    interpreter's region — one whose nearest non-`other` neighbours on both sides are the
    interpreter's (the bounding eval frames count): under `python -X perf` (CPython 3.12+) each
    eval-loop invocation is entered through a perf trampoline in anonymous memory, an `[anon]`
    frame between the eval frames that the Python frames already stand for. JIT code a C
    function calls (a non-interpreter frame on either side) stays."""
    out: list[Frame] = []
    for i, f in enumerate(seg):
        if _is_interp(f):
            continue
        if f.kind == "other":
            up = next((g for g in reversed(seg[:i]) if g.kind != "other"), None)   # None: the eval frame
            down = next((g for g in seg[i + 1:] if g.kind != "other"), None)
            if (up is None or _is_interp(up)) and (down is None or _is_interp(down)):
                continue
        out.append(f)
    return out


def _is_op_entry(f: Frame) -> bool:
    return f.kind == "native" and f.name.startswith("at::_ops::")


def splice(py: tuple[Frame, ...], entries: tuple[bool, ...], ops: tuple[str, ...],
           native: tuple[Frame, ...]) -> tuple[Frame, ...]:
    """One path, outermost first: Python → C extension → operators → native leaf.

    py/entries: the event's Python frames and, aligned with them, True where one eval-loop
    invocation begins (`Event.py_entries`). native: the unwound native stack, outermost first.
    - Below the interpreter: the native frames under the innermost interpreter frame (the C
      extension the Python code called, e.g. libtorch_python.so, then the operator's library).
      Operator frames (from the shadow stack) go right above the first `at::_ops::…` or
      libtorch_cpu frame (after the extension frames); without one, above all of them. Leaf-most MAX_NATIVE_FRAMES
      kept, a cut marked — the contract of `trim_native`.
    - Between Python runs: when the native stack holds exactly one `_PyEval_EvalFrameDefault`
      (incl. `.cold`) frame per run (run k = Python frames from the k-th entry frame on), the
      non-interpreter native frames between two eval frames (a C function calling back into
      Python: qsort, ctypes callbacks, torch autograd hooks) go between the two runs; `[anon]`
      frames among the interpreter's (perf trampolines under `python -X perf`) do not
      (`_between_runs`). Otherwise (unwind cut, no markers on 3.10, count mismatch) the Python
      frames sit above, unspliced. The leaf part is kept as unwound: a sample in the vDSO
      (clock_gettime) or in JIT code ends in its `[vdso]` / `[anon]` frame.
    Interpreter frames: those of a shared libpython3.x or of a statically linked python3.x
    executable (`_is_interp`).
    """
    native = tuple(native)
    op_frames = tuple(Frame.op(o) for o in ops)
    # index just below the innermost interpreter frame (0 if the unwind never reached one)
    cut = 0
    for i in range(len(native) - 1, -1, -1):
        if _is_interp(native[i]):
            cut = i + 1
            break
    below = native[cut:]
    j = next((i for i, f in enumerate(below) if _is_op_entry(f) or f.file.startswith(_OP_LIBS)), 0)
    ext, rest = below[:j], below[j:]
    if ext and all(f.kind == "other" for f in ext):
        ext, rest = (), ext + rest  # only a cut marker above the op library: it belongs to the leaf part
    # the op library's cap also where the unwind was cut above it (rest then starts with its marker)
    top = next((f for f in rest if f.kind != "other"), None)
    keep = MAX_OP_NATIVE_FRAMES if top is not None and (_is_op_entry(top) or top.file.startswith(_OP_LIBS)) \
        else MAX_NATIVE_FRAMES
    if len(rest) > keep:
        rest = (Frame.other("[truncated]"),) + rest[-keep:]
    if len(ext) > MAX_NATIVE_FRAMES:
        ext = (Frame.other("[truncated]"),) + ext[-MAX_NATIVE_FRAMES:]
    head = tuple(py)
    starts = [i for i, e in enumerate(entries) if e] if len(entries) == len(py) else []
    if len(starts) > 1:
        evals = [i for i, f in enumerate(native[:cut]) if _is_eval(f)]
        if len(evals) == len(starts):
            out: list[Frame] = list(py[:starts[0]])
            for k, s in enumerate(starts):
                end = starts[k + 1] if k + 1 < len(starts) else len(py)
                out.extend(py[s:end])
                if k + 1 < len(evals):
                    out.extend(_between_runs(native[evals[k] + 1:evals[k + 1]]))
            head = tuple(out)
    return head + ext + op_frames + rest
