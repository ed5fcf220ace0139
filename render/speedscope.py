"""speedscope's file format (https://www.speedscope.app/file-format-schema.json).

Pure, no privilege, no I/O. Frames are named as pprof and folded stacks name them
(render/stacks.py `frame_name`): `name` the function (`module.qualname` for Python), `file` the
short display path (a native frame's library), `line` the line.
"""

from __future__ import annotations

from typing import Any

from stacklens import __version__
from stacklens.cct.frames import ROOT, Frame
from stacklens.cct.metrics import CPU_SAMPLES
from stacklens.cct.snapshot import Snapshot
from stacklens.render.stacks import FrameName, check_measured, cpu_period_ns, frame_name, unit_of

_SPEEDSCOPE_UNIT = {"nanoseconds": "nanoseconds", "bytes": "bytes", "count": "none"}
OTHER_THREADS = "[other threads]"


def unit_and_scale(snap: Snapshot, metric: str) -> tuple[str, int]:
    """speedscope's unit for `metric` and what a value is multiplied by to be in it: CPU samples
    at a known rate (meta["cpu_hz"]) are time, samples × period in nanoseconds (pprof's `cpu`
    sample type); time metrics are nanoseconds, bytes bytes, every other count "none"."""
    if metric == CPU_SAMPLES:
        period = cpu_period_ns(snap)
        if period:
            return "nanoseconds", period
    return _SPEEDSCOPE_UNIT[unit_of(metric)], 1


class _Profile:
    """The samples of one sampled profile: a stack of frame indices and a weight each."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.samples: list[list[int]] = []
        self.weights: list[int] = []

    def add(self, stack: list[int], weight: int) -> None:
        self.samples.append(stack)
        self.weights.append(weight)

    def to_json(self, unit: str) -> dict[str, Any]:
        return {"type": "sampled", "name": self.name, "unit": unit, "startValue": 0,
                "endValue": sum(self.weights), "samples": self.samples, "weights": self.weights}


def _thread_names(snap: Snapshot) -> dict[str, str]:
    meta = snap.meta if isinstance(snap.meta, dict) else {}
    names = meta.get("threads")
    return {k: v for k, v in names.items() if isinstance(v, str) and v} if isinstance(names, dict) else {}


def _frames_and_stacks(snap: Snapshot) -> tuple[list[dict[str, Any]], list[list[int]]]:
    """The shared frames, one per distinct `frame_name` (`name`, plus `file` and `line` where
    known), and every node's stack of indices into them, outermost first (the root's is [ROOT]
    so that a value recorded on the root itself still appears)."""
    by_name: dict[FrameName, int] = {}
    by_frame: dict[Frame, int] = {}   # a name per distinct frame, not per node
    frames: list[dict[str, Any]] = []
    stacks: list[list[int]] = []
    for node in range(snap.node_count):
        frame = snap.frame_of(node) if node else ROOT
        index = by_frame.get(frame)
        if index is None:
            name = frame_name(frame)
            index = by_name.get(name)
            if index is None:
                index = by_name[name] = len(frames)
                entry: dict[str, Any] = {"name": name.function}
                if name.file:
                    entry["file"] = name.file
                if name.line:
                    entry["line"] = name.line
                frames.append(entry)
            by_frame[frame] = index
        parent = snap.parent(node)   # parents first: its stack is already there
        stacks.append(stacks[parent] + [index] if parent > 0 else [index])
    return frames, stacks


def _depth_first(snap: Snapshot) -> list[int]:
    """The nodes in depth-first order, children by id: a context's samples follow one another,
    so that speedscope's time-order view draws each context once, as a flame graph."""
    order: list[int] = []
    todo = [0]
    while todo:
        node = todo.pop()
        order.append(node)
        todo.extend(reversed(snap.children(node)))
    return order


def to_speedscope(snap: Snapshot, metric: str) -> dict[str, Any]:
    """A speedscope file (https://www.speedscope.app/file-format-schema.json) of sampled profiles,
    one sample per node with a non-zero exclusive value (frame indices outermost first), weighted
    by that value in `unit_and_scale`'s unit, in depth-first order (`_depth_first`).

    The first profile (the one speedscope opens on) is the whole process. For a metric counted by
    thread (`Snapshot.threads`: CPU and Python samples) one more per thread follows, the largest
    first, named by the thread's name (meta["threads"]) and tid, as pprof labels its samples, and
    one for what the listed threads leave (`[other threads]`) when anything is left: they add up
    to the whole process's."""
    check_measured(snap, metric)
    unit, scale = unit_and_scale(snap, metric)
    frames, stacks = _frames_and_stacks(snap)
    title = str(snap.meta.get("name", "stacklens")) if isinstance(snap.meta, dict) else "stacklens"
    threaded = metric in snap.threaded
    whole = _Profile(f"{title} {metric}" + (" · all threads" if threaded else ""))
    by_tid: dict[int, _Profile] = {}
    names = _thread_names(snap)
    rest = _Profile(f"{title} {metric} · {OTHER_THREADS}")
    column = snap.exclusive_column(metric)
    for node in _depth_first(snap):
        value = column[node]
        if not value:
            continue
        whole.add(stacks[node], value * scale)
        if threaded:
            for tid, count in snap.threads(node, metric):
                thread = by_tid.get(tid)
                if thread is None:
                    label = f"{names[str(tid)]} (tid {tid})" if str(tid) in names else f"tid {tid}"
                    thread = by_tid[tid] = _Profile(f"{title} {metric} · {label}")
                thread.add(stacks[node], count * scale)
                value -= count
            if value:
                rest.add(stacks[node], value * scale)
    threads = sorted(by_tid.items(), key=lambda item: (-sum(item[1].weights), item[0]))
    profiles = [whole, *(p for _, p in threads), *([rest] if rest.samples else [])]
    return {
        "$schema": "https://www.speedscope.app/file-format-schema.json",
        "shared": {"frames": frames},
        "profiles": [p.to_json(unit) for p in profiles],
        "name": title,
        "activeProfileIndex": 0,
        "exporter": f"stacklens {__version__}",
    }
