"""Ground truth for the backward link (issue 18): GPU time per model line and module class,
forward and backward, from torch.profiler, against what stacklens charged.

The truth: tests/targets/gpu_workloads.py `truth N PATH` profiles N training steps (CPU+CUDA,
with_stack) and writes every CPU event with its parent, sequence number, forward thread, Python
stack and kernels. With with_stack, torch's Python tracer makes each Python call an event of its
own ("transformers/models/gpt2/modeling_gpt2.py(688): forward": the file relative to its
sys.path entry, the line the function's `def`), the parent of the ops it calls; older versions
put the stack on the op. Lines therefore differ between the sides (a def line there, the calling
line here): the comparison is per module class, the class whose body holds the line. Where an op
has no Python-call ancestor (the tracer's events may sit on a thread id of their own, so they are
nobody's parent), the innermost model-file Python-call event enclosing the op in time stands in.
A kernel belongs to the innermost op that launched it; it is backward work when
an ancestor is `autograd::engine::evaluate_function: NODE`, and then its Python line is the one of
the forward op with the node's (sequence number, forward thread), as torch.profiler links them.
Ours: a path's GPU time is backward when it holds a `backward:` frame; its line is the innermost
Python frame of the model's source above it.
Pure (stdlib + stacklens.cct); the experiment that produces both sides is benchmarks/gpu/check_backward.py.
"""

from __future__ import annotations

import ast
import bisect
import functools
import os
import re
import sys
from collections import defaultdict
from typing import Callable, Iterable

EVAL = "autograd::engine::evaluate_function: "
_FRAME = re.compile(r"^(?P<file>.*)\((?P<line>\d+)\): (?P<func>.*)$")
COPY_PREFIXES = ("Memcpy", "Memset")   # compared apart: the copies are issue 23's


def parse_stack(stack: list[str]) -> list[tuple[str, int]]:
    """torch.profiler's stack strings ("file.py(42): forward"), innermost first."""
    frames = []
    for s in stack:
        m = _FRAME.match(s)
        if m:
            frames.append((m["file"], int(m["line"]), m["func"]))
    if frames and frames[0][2] == "<module>" and frames[-1][2] != "<module>":
        frames.reverse()                   # outermost first as given: make it innermost first
    return [(f, ln) for f, ln, _ in frames]


def innermost(frames: Iterable[tuple[str, int]], is_model: Callable[[str], bool]) -> tuple[str, int] | None:
    return next(((f, ln) for f, ln in frames if is_model(f)), None)


def truth_by_line(events: list[dict], is_model: Callable[[str], bool], steps: int) -> dict:
    """{(file, line, phase): kernel µs per step}; phase "fwd" | "bwd"; line None = no model line."""
    def chain(i: int):
        while i >= 0:
            yield i, events[i]
            i = events[i]["parent"]

    calls = sorted((e["start"], e["end"], m["file"], int(m["line"])) for e in events
                   if "start" in e and (m := _FRAME.match(e["name"])) and is_model(m["file"]))
    starts = [c[0] for c in calls]

    def enclosing(e: dict) -> tuple[str, int] | None:
        """The innermost model-file Python call whose interval holds the event's (nesting: scanning
        back from the latest start before it, the first that has not ended encloses it)."""
        if "start" not in e:
            return None
        k = bisect.bisect_right(starts, e["start"]) - 1
        while k >= 0:
            if calls[k][1] >= e["end"]:
                return calls[k][2], calls[k][3]
            k -= 1
        return None

    def stack_line(i: int) -> tuple[str, int] | None:
        for _, e in chain(i):                       # innermost first: Python-call events, op stacks
            m = _FRAME.match(e["name"])
            if m and is_model(m["file"]):
                return m["file"], int(m["line"])
            if e["stack"]:
                found = innermost(parse_stack(e["stack"]), is_model)
                if found:
                    return found
        return enclosing(events[i])

    forward: dict[tuple[int, int], int] = {}        # (seq, thread) -> outermost forward op
    for i, e in enumerate(events):
        if e["seq"] is not None and e["seq"] >= 0 and not e["name"].startswith(EVAL):
            if not any(a["name"].startswith(EVAL) for _, a in chain(e["parent"])):
                key = (e["seq"], e["thread"])
                if key not in forward or _depth(events, i) < _depth(events, forward[key]):
                    forward[key] = i
    out: dict = defaultdict(float)
    for i, e in enumerate(events):
        us = sum(d for name, d in e["kernels"] if not name.startswith(COPY_PREFIXES))
        if not us:
            continue
        node = next((a for _, a in chain(i) if a["name"].startswith(EVAL)), None)
        if node is None:
            line, phase = stack_line(i), "fwd"
        else:
            fwd = forward.get((node["seq"], node["fwd"]))
            line, phase = (stack_line(fwd) if fwd is not None else None), "bwd"
        out[(line[0] if line else None, line[1] if line else None, phase)] += us / steps
    return dict(out)


MODULE = "module:"          # gpu_workloads.py mark_modules(): one range per nn.Module call
NO_MODULE = "[no module]"


def truth_by_module(events: list[dict], steps: int) -> dict:
    """{(module class, phase): kernel µs per step}: a kernel's class is the innermost `module:`
    range around the op that launched it; for backward work, around the forward op of the
    node's (sequence number, forward thread)."""
    def chain(i: int):
        while i >= 0:
            yield events[i]
            i = events[i]["parent"]

    def module_of(i: int | None) -> str:
        if i is None:
            return NO_MODULE
        return next((e["name"][len(MODULE):] for e in chain(i) if e["name"].startswith(MODULE)), NO_MODULE)

    # the op that created the node: of the forward ops that saw sequence number N (an op records
    # the next number at its start; the one that takes it creates node N), the last to start
    forward: dict[tuple[int, int], int] = {}
    for i, e in enumerate(events):
        if e["seq"] is not None and e["seq"] >= 0 and not e["name"].startswith((EVAL, MODULE)):
            if not any(a["name"].startswith(EVAL) for a in chain(e["parent"])):
                key = (e["seq"], e["thread"])
                if key not in forward or e.get("start", 0) >= events[forward[key]].get("start", 0):
                    forward[key] = i
    out: dict = defaultdict(float)
    for i, e in enumerate(events):
        us = sum(d for name, d in e["kernels"] if not name.startswith(COPY_PREFIXES))
        if not us:
            continue
        node = next((a for a in chain(i) if a["name"].startswith(EVAL)), None)
        if node is None:
            out[(module_of(i), "fwd")] += us / steps
        else:
            out[(module_of(forward.get((node["seq"], node["fwd"]))), "bwd")] += us / steps
    return dict(out)


def module_of_frames(frames) -> str:
    """The innermost `Class.forward` Python frame's class (qualnames, CPython 3.11+)."""
    for f in reversed(frames):
        if f.kind == "python" and f.name.endswith(".forward"):
            return f.name[: -len(".forward")].rsplit(".", 1)[-1]
    return NO_MODULE


def _kernel_paths(snap, steps: int):
    """(frames above the kernel's backward frame — its forward context — or the whole path,
    phase, kernel µs per step) for every path with GPU time, copies and memsets left out."""
    for path, excl in snap.iter_paths():
        ns = excl.get("gpu_time_ns", 0)
        if not ns or any(f.kind in ("memcpy", "memset") for f in path):
            continue
        cut = next((k for k, f in enumerate(path) if f.kind == "backward"), None)
        yield (path[:cut] if cut is not None else path), ("bwd" if cut is not None else "fwd"), ns / 1e3 / steps


def ours_by_module(snap, steps: int) -> dict:
    """{(module class, phase): kernel µs per step}: the innermost `Class.forward` frame above the
    kernel (above the `backward:` frame for backward work, i.e. in its forward context)."""
    out: dict = defaultdict(float)
    for above, phase, us in _kernel_paths(snap, steps):
        out[(module_of_frames(above), phase)] += us
    return dict(out)


def compare_modules(ours: dict, truth: dict, *, min_share: float = 0.01) -> dict:
    """Per module class: both sides' forward and backward µs per step, the error of their sum;
    the worst error among classes with at least `min_share` of the GPU time."""
    classes = sorted({c for c, _ in ours} | {c for c, _ in truth},
                     key=lambda c: -(truth.get((c, "fwd"), 0) + truth.get((c, "bwd"), 0)))
    total = sum(truth.values()) or 1.0
    rows, worst = [], 0.0
    for c in classes:
        o = {ph: ours.get((c, ph), 0.0) for ph in ("fwd", "bwd")}
        t = {ph: truth.get((c, ph), 0.0) for ph in ("fwd", "bwd")}
        tsum, osum = t["fwd"] + t["bwd"], o["fwd"] + o["bwd"]
        err = (osum - tsum) / tsum if tsum else (None if osum else 0.0)
        share = tsum / total
        if share >= min_share:
            worst = max(worst, abs(err) if err is not None else float("inf"))
        rows.append({"class": c, "ours_fwd_us": round(o["fwd"], 1), "ours_bwd_us": round(o["bwd"], 1),
                     "truth_fwd_us": round(t["fwd"], 1), "truth_bwd_us": round(t["bwd"], 1),
                     "share": round(share, 4), "error": None if err is None else round(err, 4)})
    return {"rows": rows, "worst_class_error": round(worst, 4), "pass": worst <= 0.03}


def _depth(events: list[dict], i: int) -> int:
    d = 0
    while events[i]["parent"] >= 0:
        i, d = events[i]["parent"], d + 1
    return d


def ours_by_line(snap, is_model: Callable[[str], bool], steps: int) -> dict:
    """{(file, line, phase): kernel µs per step} from a window of stacklens' tree."""
    out: dict = defaultdict(float)
    for above, phase, us in _kernel_paths(snap, steps):
        line = innermost([(f.file, f.line) for f in reversed(above) if f.kind == "python"], is_model)
        out[(line[0] if line else None, line[1] if line else None, phase)] += us
    return dict(out)


@functools.lru_cache(maxsize=256)
def _classes(file: str) -> list[tuple[int, int, str]]:
    if not os.path.isabs(file):   # torch.profiler's files are relative to their sys.path entry
        file = next((os.path.join(p, file) for p in sys.path if os.path.isfile(os.path.join(p, file))), file)
    try:
        with open(file) as fh:
            tree = ast.parse(fh.read())
    except (OSError, SyntaxError, ValueError):
        return []
    return [(n.lineno, n.end_lineno or n.lineno, n.name) for n in ast.walk(tree) if isinstance(n, ast.ClassDef)]


def class_of(file: str | None, line: int | None) -> str:
    """The innermost class whose body holds the line ("GPT2MLP"), else the file's basename."""
    if not file:
        return "[no model line]"
    best = None
    for lo, hi, name in _classes(file):
        if lo <= (line or 0) <= hi and (best is None or lo >= best[0]):
            best = (lo, name)
    return best[1] if best else file.rsplit("/", 1)[-1]


def by_class(lines: dict) -> dict:
    out: dict = defaultdict(lambda: {"fwd": 0.0, "bwd": 0.0})
    for (file, line, phase), us in lines.items():
        out[class_of(file, line)][phase] += us
    return {k: dict(v) for k, v in out.items()}


def compare(ours: dict, truth: dict, *, min_share: float = 0.01) -> dict:
    """Per module class: both sides' forward and backward µs per step and the error of their sum;
    the share of backward GPU time with a model line (ours); the verdict of acceptance 1."""
    oc, tc = by_class(ours), by_class(truth)
    total = sum(v["fwd"] + v["bwd"] for v in tc.values()) or 1.0
    rows, worst = [], 0.0
    for cls in sorted(set(oc) | set(tc), key=lambda c: -(tc.get(c, {"fwd": 0, "bwd": 0})["fwd"]
                                                      + tc.get(c, {"fwd": 0, "bwd": 0})["bwd"])):
        o, t = oc.get(cls, {"fwd": 0.0, "bwd": 0.0}), tc.get(cls, {"fwd": 0.0, "bwd": 0.0})
        tsum, osum = t["fwd"] + t["bwd"], o["fwd"] + o["bwd"]
        err = (osum - tsum) / tsum if tsum else float("inf") if osum else 0.0
        share = tsum / total
        if share >= min_share and cls != "[no model line]":
            worst = max(worst, abs(err))
        rows.append({"class": cls, "ours_fwd_us": round(o["fwd"], 1), "ours_bwd_us": round(o["bwd"], 1),
                     "truth_fwd_us": round(t["fwd"], 1), "truth_bwd_us": round(t["bwd"], 1),
                     "share": round(share, 4), "error": round(err, 4) if err != float("inf") else None})
    truth_lined = sum(us for (f, _, ph), us in truth.items() if f) / (sum(truth.values()) or 1.0)
    bwd_total = sum(us for (f, _, ph), us in ours.items() if ph == "bwd")
    bwd_lined = sum(us for (f, _, ph), us in ours.items() if ph == "bwd" and f)
    truth_bwd = sum(us for (f, _, ph), us in truth.items() if ph == "bwd")
    truth_all = sum(truth.values()) or 1.0
    return {"rows": rows, "worst_class_error": round(worst, 4),
            "ours_backward_with_line": round(bwd_lined / bwd_total, 4) if bwd_total else None,
            "truth_backward_share": round(truth_bwd / truth_all, 4),
            "truth_with_line": round(truth_lined, 4),
            "ours_total_us": round(sum(ours.values()), 1), "truth_total_us": round(sum(truth.values()), 1),
            # a truth that cannot name the lines proves nothing: it must place 95% itself
            "pass": bool(bwd_total) and bwd_lined / bwd_total >= 0.95 and worst <= 0.03 and truth_lined >= 0.95}
