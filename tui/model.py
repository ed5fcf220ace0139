"""View models of the TUI: pure functions from a `Snapshot` (plus UI state) to rows and blocks.

No privilege, no I/O except `source_excerpt` (reads a source file, bounded), no Textual: every
function here is unit-tested without an app. Cost is bounded by what is on screen or expanded,
never by the size of the tree, except `search_nodes` and `hotspots` (one O(nodes) scan each).
"""

from __future__ import annotations

import heapq
import math
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Sequence

from stacklens.cct import Frame, metrics
from stacklens.cct.labels import ON_SCREEN, context_label, frame_text
from stacklens.cct.modelview import FULL, MODEL, has_model, model_view
from stacklens.tui.processes import ProcessRow, cpu_shares, process_cells  # noqa: F401 - the view models, in one place

# The snapshot type is duck-typed (cct.Snapshot or anything with the same reading API).
Snap = Any
Key = tuple  # a node's path of frames from the root: stable across snapshots, unlike node ids

WINDOWS: tuple[float | None, ...] = (None, 10.0, 60.0)
SORTS = ("inclusive", "exclusive", "name")
# Metric shown first, and the hotspot columns: from the registry (cct/metrics.py).
PREFERRED_METRICS = metrics.PREFERRED
HOTSPOT_METRICS = metrics.HOTSPOT
MAX_CHILDREN = 200  # per expanded node; the rest are summed into one "… N more" row

_KIND_TAG = {
    "python": "py",
    "op": "op",
    "native": "nat",
    "gpu_api": "api",
    "kernel": "krn",
    "instruction": "ins",
    "backward": "bwd",
    "module": "mod",
    "other": "",
}
KIND_STYLE = {
    "python": "green",
    "op": "cyan",
    "native": "white",
    "gpu_api": "yellow",
    "kernel": "magenta",
    "instruction": "blue",
    "backward": "red",
    "module": "bright_green",
    "other": "bright_black",
}


# ---- formatting ----------------------------------------------------------------------------


def window_label(window_s: float | None) -> str:
    return "cumulative" if window_s is None else f"last {window_s:g} s"


def metric_label(metric: str) -> str:
    return metrics.label_of(metric)


def fmt_value(metric: str, value: int | float, *, signed: bool = False) -> str:
    """Human units from the registry: times as us/ms/s, bytes as KiB/MiB/GiB, counts as 1.2k/3.4M."""
    return metrics.fmt_value(metric, value, signed=signed)


def fmt_share(value: int | float, total: int | float, *, signed: bool = False) -> str:
    """`value` as a % of `total`; `signed` (a diff) keeps the sign: +12.0% grew, -3.5% shrank."""
    if not total:
        return "  -  "
    if signed:
        return f"{100.0 * value / total:+6.1f}%" if value else "   0.0%"
    return f"{100.0 * value / total:5.1f}%"


# A sampled metric and the meta key of its sampling rate (Hz): with the rate known, samples are
# shown as time (samples / rate); without it, as sample counts, labelled "samples".
SAMPLE_RATES = {metrics.CPU_SAMPLES: "cpu_hz"}


@dataclass(frozen=True, slots=True)
class Unit:
    """How a metric's values are shown: in the metric's own unit, or a sample count as time."""

    metric: str
    hz: float = 0.0  # samples per second of a sampled metric; 0: shown as it is stored

    @property
    def label(self) -> str:
        return "cpu time" if self.hz else metric_label(self.metric)

    def fmt(self, value: int | float, *, signed: bool = False) -> str:
        if self.hz:
            return metrics.fmt_quantity(metrics.TIME, value * 1e9 / self.hz, signed=signed)
        return fmt_value(self.metric, value, signed=signed)


def unit_of(snap: Snap | None, metric: str) -> Unit:
    """The metric's unit in this snapshot: time where it is a sample count whose rate the
    snapshot's meta carries (the daemon's `cpu_hz`; a window or a diff keeps it when both agree)."""
    key = SAMPLE_RATES.get(metric)
    meta = getattr(snap, "meta", None)
    if key is None or not isinstance(meta, dict):
        return Unit(metric)
    try:
        hz = float(meta.get(key) or 0)
    except (TypeError, ValueError):
        hz = 0.0
    return Unit(metric, hz if math.isfinite(hz) and hz > 0 else 0.0)


_EIGHTHS = " ▏▎▍▌▋▊▉"


def bar(fraction: float, width: int) -> str:
    """A left-aligned bar of `width` cells filled to `fraction` (clamped to [0, 1]), in 1/8 cells."""
    if width <= 0:
        return ""
    fraction = 0.0 if math.isnan(fraction) else min(1.0, max(0.0, fraction))
    eighths = round(fraction * width * 8)
    full, part = divmod(eighths, 8)
    text = "█" * full + (_EIGHTHS[part] if part and full < width else "")
    return text.ljust(width)


def kind_tag(frame: Frame) -> str:
    return _KIND_TAG.get(frame.kind, "")


# ---- metric choice -------------------------------------------------------------------------


def default_metric(snap: Snap) -> str:
    return metrics.opening_metric(snap)


def measured_metrics(snap: Snap) -> tuple[str, ...]:
    """The snapshot's metrics that were measured (not in `unavailable`) and recorded something."""
    return tuple(m for m in snap.metrics if m not in snap.unavailable and snap.total(m))


def next_metric(snap: Snap | None, current: str, step: int = 1) -> str:
    """The next metric `m` shows: only measured ones; `current` stays when there is none."""
    names = measured_metrics(snap) if snap is not None else ()
    if not names:
        return current
    if current not in names:
        return names[0] if step > 0 else names[-1]
    return names[(names.index(current) + step) % len(names)]


# ---- model view / full view -----------------------------------------------------------------


def shown_snapshot(raw: Snap, view: str) -> tuple[Snap, str]:
    """The snapshot the views show and the view it is in: `view` "model" or "full", or "auto"
    (the model view where the profile has torch module calls, cct/modelview.py)."""
    if view not in (MODEL, FULL):
        view = MODEL if has_model(raw) else FULL
    return (model_view(raw) if view == MODEL else raw), view


def other_view(view: str) -> str:
    return FULL if view == MODEL else MODEL


# ---- the tree ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Row:
    """One line of the tree view: a node, or a chain of single-child nodes shown as one line."""

    node: int  # the last node of the chain: the one whose children an expansion shows
    chain: tuple[int, ...]  # every node this row stands for, outermost first
    frames: tuple[Frame, ...]
    key: Key  # path of `node` from the root
    depth: int
    incl: int  # inclusive value of the chain (= of its first node)
    excl: int  # exclusive values summed over the chain
    has_children: bool
    expanded: bool
    more: int = 0  # > 0: a "… N more" row summarising N hidden siblings (node = their parent)

    @property
    def label(self) -> str:
        if self.more:
            return f"… {self.more} more"
        return " › ".join(frame_text(f) for f in self.frames)


def _value_columns(snap: Snap, metric: str) -> tuple[Callable[[int], int], Callable[[int], int]]:
    return (lambda n: snap.inclusive(n, metric)), (lambda n: snap.exclusive(n, metric))


def _visible_children(snap: Snap, node: int, incl: Callable[[int], int]) -> list[int]:
    return [c for c in snap.children(node) if incl(c)]


def tree_rows(
    snap: Snap,
    metric: str,
    expanded: set[Key] | frozenset[Key],
    *,
    sort: str = "inclusive",
    collapse_chains: bool = True,
    max_children: int = MAX_CHILDREN,
) -> list[Row]:
    """Rows of the expanded part of the tree, depth first, each level sorted by `sort`.

    Children with a zero value of `metric` are hidden. A node with exactly one visible child is
    merged with it into one row (so `train.py:step → aten::linear → aten::addmm` is one line),
    unless `collapse_chains` is off. Diff snapshots are sorted by absolute value.
    """
    if metric not in snap.metrics:
        return []
    incl, excl = _value_columns(snap, metric)
    rows: list[Row] = []

    def sort_children(kids: list[int]) -> list[int]:
        if sort == "name":
            return sorted(kids, key=lambda c: frame_text(snap.frame_of(c)).lower())
        value = excl if sort == "exclusive" else incl
        return sorted(kids, key=lambda c: (-abs(value(c)), c))

    def emit(parent: int, parent_key: Key, depth: int) -> None:
        kids = sort_children(_visible_children(snap, parent, incl))
        shown = kids[:max_children]
        for child in shown:
            chain = [child]
            frames = [snap.frame_of(child)]
            total_excl = excl(child)
            grandkids = _visible_children(snap, child, incl)
            while collapse_chains and len(grandkids) == 1:
                nxt = grandkids[0]
                chain.append(nxt)
                frames.append(snap.frame_of(nxt))
                total_excl += excl(nxt)
                grandkids = _visible_children(snap, nxt, incl)
            key = parent_key + tuple(frames)
            is_open = bool(grandkids) and key in expanded
            rows.append(
                Row(
                    node=chain[-1],
                    chain=tuple(chain),
                    frames=tuple(frames),
                    key=key,
                    depth=depth,
                    incl=incl(child),
                    excl=total_excl,
                    has_children=bool(grandkids),
                    expanded=is_open,
                )
            )
            if is_open:
                emit(chain[-1], key, depth + 1)
        if len(kids) > len(shown):
            hidden = kids[len(shown) :]
            rows.append(
                Row(
                    node=parent,
                    chain=(),
                    frames=(),
                    key=parent_key + (Frame.other("more"),),
                    depth=depth,
                    incl=sum(incl(c) for c in hidden),
                    excl=0,
                    has_children=False,
                    expanded=False,
                    more=len(hidden),
                )
            )

    emit(snap.root, (), 0)
    return rows


def hot_path_keys(snap: Snap, metric: str, start: int | None = None, *, max_depth: int = 64) -> set[Key]:
    """Keys that expand the heaviest child at each level from `start` (default: the root) down.

    Every prefix of the hot path is returned, so the expansion works whether or not single-child
    chains are collapsed.
    """
    if metric not in snap.metrics:
        return set()
    node = snap.root if start is None else start
    path = list(snap.path(node)) if node != snap.root else []
    keys: set[Key] = set()
    for _ in range(max_depth):
        kids = [c for c in snap.children(node) if snap.inclusive(c, metric)]
        if not kids:
            break
        node = max(kids, key=lambda c: (abs(snap.inclusive(c, metric)), -c))
        path.append(snap.frame_of(node))
        keys.add(tuple(path))
    return keys


def ancestor_keys(snap: Snap, node: int) -> set[Key]:
    """Every proper prefix of `node`'s path: expanding these makes `node` visible."""
    path = snap.path(node)
    return {path[:i] for i in range(1, len(path))}


def row_index_of(rows: Sequence[Row], node: int) -> int | None:
    for i, row in enumerate(rows):
        if node in row.chain:
            return i
    return None


def row_index_of_key(rows: Sequence[Row], key: Key) -> int | None:
    for i, row in enumerate(rows):
        if row.key == key:
            return i
    # the row may now be part of a longer or shorter chain: a row covering the key, else the
    # deepest row above it
    best, best_len = None, 0
    for i, row in enumerate(rows):
        if not row.frames:
            continue
        start = len(row.key) - len(row.frames)
        if len(row.key) >= len(key) > start and row.key[: len(key)] == key:
            return i
        if len(row.key) < len(key) and len(row.key) > best_len and key[: len(row.key)] == row.key:
            best, best_len = i, len(row.key)
    return best


def search_nodes(snap: Snap, query: str, metric: str, *, limit: int = 1000) -> list[int]:
    """Nodes whose label contains `query` (case-insensitive), heaviest by `metric` first."""
    q = query.strip().lower()
    if not q:
        return []
    labels: dict[Frame, bool] = {}
    hits = []
    use_metric = metric in snap.metrics
    for n in range(1, snap.node_count):
        f = snap.frame_of(n)
        ok = labels.get(f)
        if ok is None:
            ok = q in f.label().lower() or q in frame_text(f).lower()
            labels[f] = ok
        if ok:
            hits.append(n)
    if use_metric:
        return heapq.nsmallest(limit, hits, key=lambda n: (-abs(snap.inclusive(n, metric)), n))
    return hits[:limit]


# ---- icicle (flame graph, top down) --------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Block:
    start: int
    width: int
    node: int
    frame: Frame
    value: int


def icicle(snap: Snap, metric: str, root: int, width: int, max_depth: int) -> list[list[Block]]:
    """Levels of an icicle graph of `root`'s subtree: level 0 is `root` over the full width.

    Children are laid out left to right, heaviest first, each as wide as its share of the
    parent's (absolute) inclusive value; blocks under one cell are dropped.
    """
    if metric not in snap.metrics or width <= 0:
        return []
    total = abs(snap.inclusive(root, metric))
    if not total:
        return []
    levels: list[list[Block]] = [[Block(0, width, root, snap.frame_of(root), snap.inclusive(root, metric))]]
    scale = width / total
    for _ in range(max_depth - 1):
        nxt: list[Block] = []
        for parent in levels[-1]:
            x = float(parent.start)
            kids = sorted(
                (c for c in snap.children(parent.node) if snap.inclusive(c, metric)),
                key=lambda c: -abs(snap.inclusive(c, metric)),
            )
            for c in kids:
                v = snap.inclusive(c, metric)
                w = abs(v) * scale
                start, end = round(x), round(x + w)
                x += w
                if end - start >= 1:
                    nxt.append(Block(start, end - start, c, snap.frame_of(c), v))
        if not nxt:
            break
        levels.append(nxt)
    return levels


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


# ---- process list, advice, status ----------------------------------------------------------


@dataclass(frozen=True)
class Evidence:
    metric: str
    value: float
    unit: str = ""


@dataclass(frozen=True)
class Advice:
    rule: str
    severity: str
    title: str
    fix: str
    path: tuple[str, ...] = ()  # frame labels, outermost first
    evidence: tuple[Evidence, ...] = ()
    saving_share: float = 0.0


_SEVERITY_ORDER = {"critical": 0, "high": 1, "warning": 2, "medium": 2, "info": 3, "low": 3}


def sort_advice(items: Iterable[Advice]) -> list[Advice]:
    return sorted(items, key=lambda a: (_SEVERITY_ORDER.get(a.severity.lower(), 9), -a.saving_share, a.rule))


def advice_lines(a: Advice) -> list[str]:
    """Plain text lines describing one finding (the Advice panel styles and wraps them)."""
    head = f"[{a.severity}] {a.rule}: {a.title}"
    lines = [head]
    if a.path:
        tail = [frame_text(_frame_or_other(lbl)) for lbl in a.path[-4:]]
        lines.append("    at " + " › ".join(tail))
    if a.evidence:
        lines.append("    evidence: " + ", ".join(f"{ev.metric}={ev.value:g}{(' ' + ev.unit) if ev.unit else ''}" for ev in a.evidence))
    lines.append(f"    fix: {a.fix}")
    if a.saving_share:
        lines.append(f"    estimated saving: {100 * a.saving_share:.0f}%")
    return lines


def _frame_or_other(label: str) -> Frame:
    try:
        return Frame.from_label(label)
    except ValueError:
        return Frame.other(label)


@dataclass
class Status:
    """What the status line shows; `status_text` renders it."""

    source: str = ""
    state: str = ""
    window_s: float | None = None
    metric: str = ""
    diff: bool = False
    paused: bool = False
    nodes: int = 0
    folded: int = 0
    stats: dict[str, int] = field(default_factory=dict)
    unavailable: tuple[str, ...] = ()
    message: str = ""
    view: str = ""  # "model": the model view (said in the line); "full" or "" say nothing
    unit: str = ""  # the metric's label in the unit shown ("cpu time" for samples at a known rate)


def status_text(s: Status) -> str:
    """Most important first, so a narrow terminal cuts the least useful part (the title bar
    already names the source)."""
    parts = [s.state] if s.state else []
    view = window_label(s.window_s)
    if s.diff:
        view = f"diff {view} vs the {s.window_s:g} s before" if s.window_s else "diff"
    parts.append(view)
    if s.metric:
        parts.append(f"metric {s.unit or metric_label(s.metric)}")
    if s.view == MODEL:
        parts.append("model view (v: full)")
    drop_keys = [k for k in s.stats if "drop" in k or "lost" in k]
    if drop_keys:  # a saved file has no drop counters: say nothing rather than "0"
        parts.append(f"drops {sum(s.stats[k] for k in drop_keys):,}")
    if s.unavailable:
        parts.append("unavailable: " + ", ".join(metric_label(m) for m in s.unavailable))
    if s.paused:
        parts.append("PAUSED")
    if s.message:
        parts.append(s.message)
    parts.append(f"{s.nodes:,} node{'' if s.nodes == 1 else 's'}" + (f" ({s.folded:,} folded)" if s.folded else ""))
    return " · ".join(parts)


# Dropped first when a chain does not fit: plumbing (native, API) before the user's own code.
_DROP_ORDER = {"native": 0, "other": 1, "instruction": 2, "gpu_api": 3, "kernel": 4, "python": 5, "module": 5,
               "op": 6, "backward": 7}
SEP = " › "


def chain_item_text(frame: Frame, tags: bool = True) -> str:
    tag = kind_tag(frame) if tags else ""
    return f"{tag} {frame_text(frame)}" if tag else frame_text(frame)


def fit_chain(frames: Sequence[Frame], width: int, *, tags: bool = True) -> list[Frame | None]:
    """The frames of a collapsed chain that fit in `width` cells; None marks an elided run.

    Always kept: the first and last frames, the innermost Python or module frame and the
    operator it called (the "which line, which op" answer). Dropped first: native and API frames, then
    kernels, then outer Python frames, then inner operators. What still does not fit is left
    for the caller to truncate.
    """
    frames = list(frames)

    def length(seq: list[Frame | None]) -> int:
        return sum(len(chain_item_text(f, tags)) if f is not None else 1 for f in seq) + len(SEP) * (len(seq) - 1)

    if length(frames) <= width or len(frames) <= 2:
        return frames
    must = {0, len(frames) - 1}
    py = [i for i, f in enumerate(frames) if f.kind in ("python", "module")]
    if py:
        must.add(py[-1])
        op = next((i for i in range(py[-1] + 1, len(frames)) if frames[i].kind == "op"), None)
        if op is not None:
            must.add(op)
    order = sorted(
        (i for i in range(len(frames)) if i not in must),
        # outer Python frames go before inner ones; inner operators before outer ones
        key=lambda i: (_DROP_ORDER.get(frames[i].kind, 0), i if frames[i].kind in ("python", "module") else -i),
    )
    keep = set(range(len(frames)))
    out: list[Frame | None] = frames
    for drop in order:
        keep.discard(drop)
        out = []
        for i, f in enumerate(frames):
            if i in keep:
                out.append(f)
            elif not out or out[-1] is not None:
                out.append(None)
        if length(out) <= width:
            break
    return out
