"""View models of the hotspots and source views: where in the code the metric goes.

No privilege, no Textual; I/O only in `source_excerpt` (reads a source file, bounded). `hotspots`
and `line_values` scan the tree once each (O(nodes)).
"""

from __future__ import annotations

import heapq
import os
from dataclasses import dataclass
from typing import Iterable, Iterator, Sequence

from stacklens.cct import Frame, metrics
from stacklens.cct.labels import ON_SCREEN, context_label
from stacklens.tui.formatting import Snap

HOTSPOT_METRICS = metrics.HOTSPOT   # the hotspot columns, from the registry (cct/metrics.py)


# ---- hotspots ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Hotspot:
    node: int
    frame: Frame
    context: str  # the nearest Python frame above (or at) the node, and the nearest operator
    values: dict[str, int]


def _frames_up(snap: Snap, node: int) -> Iterator[Frame]:
    while node > 0:
        yield snap.frame_of(node)
        node = snap.parent(node)


def context_of(snap: Snap, node: int) -> str:
    """The nearest Python frame above (or at) the node and the nearest operator (cct/labels.py)."""
    return context_label(_frames_up(snap, node), ON_SCREEN)


def hotspots(
    snap: Snap, metric: str, *, k: int = 100, columns: Sequence[str] = HOTSPOT_METRICS, signed: bool = False
) -> list[Hotspot]:
    """The k contexts with the largest exclusive `metric` (absolute, for a diff: `signed`)."""
    if metric not in snap.metrics:
        return []
    top = getattr(snap, "top", None)
    if top is not None and not signed:
        nodes = top(metric, k)
    else:
        nodes = heapq.nsmallest(
            k,
            (n for n in range(1, snap.node_count) if snap.exclusive(n, metric)),
            key=lambda n: (-abs(snap.exclusive(n, metric)), n),
        )
    cols = [c for c in dict.fromkeys((metric, *columns)) if c in snap.metrics]
    return [
        Hotspot(n, snap.frame_of(n), context_of(snap, n), {c: snap.exclusive(n, c) for c in cols}) for n in nodes
    ]


# ---- source --------------------------------------------------------------------------------


def nearest_python(snap: Snap, node: int) -> Frame | None:
    n = node
    while n > 0:
        f = snap.frame_of(n)
        if f.kind == "python":
            return f
        n = snap.parent(n)
    return None


def line_values(snap: Snap, metric: str, file: str) -> dict[int, int]:
    """Per line of `file`: the inclusive `metric` of the contexts running that line, each
    counted once (a line under itself, as in recursion, is not counted twice). One O(nodes) scan."""
    if metric not in snap.metrics or not file:
        return {}
    out: dict[int, int] = {}
    for n in range(1, snap.node_count):
        f = snap.frame_of(n)
        if f.kind != "python" or f.file != file:
            continue
        value = snap.inclusive(n, metric)
        if not value:
            continue
        up = snap.parent(n)
        while up > 0:
            g = snap.frame_of(up)
            if g.kind == "python" and g.file == file and g.line == f.line:
                break
            up = snap.parent(up)
        else:
            out[f.line] = out.get(f.line, 0) + value
    return out


@dataclass(frozen=True)
class Excerpt:
    frame: Frame | None
    path: str
    first_line: int  # 1-based number of lines[0]
    lines: tuple[str, ...]
    message: str = ""


def source_excerpt(
    frame: Frame | None, *, context: int = 12, roots: Iterable[str] = ("",), max_bytes: int = 4 << 20
) -> Excerpt:
    """Lines around a Python frame's line, read from the first of `roots` + file that opens.

    `roots` lets the caller try the target's mount namespace (`/proc/PID/root`) first.
    """
    if frame is None or frame.kind != "python":
        return Excerpt(frame, "", 0, (), "no Python frame on this path: select a py row in the tree")
    if not frame.file or frame.file.startswith("<"):
        return Excerpt(frame, frame.file, 0, (), f"{frame.file or 'this frame'} has no source file")
    last_err = ""
    for root in roots:
        path = root + frame.file if root else frame.file
        try:
            if os.path.getsize(path) > max_bytes:
                return Excerpt(frame, path, 0, (), f"{path} is larger than {max_bytes >> 20} MiB; not shown")
            with open(path, encoding="utf-8", errors="replace") as fh:
                text = fh.read().splitlines()
        except OSError as e:
            last_err = f"{frame.file}: {e.strerror or e}"
            continue
        line = max(1, frame.line)
        lo = max(1, line - context)
        hi = min(len(text), line + context)
        return Excerpt(frame, path, lo, tuple(text[lo - 1 : hi]))
    return Excerpt(frame, frame.file, 0, (), f"source not readable ({last_err})")
