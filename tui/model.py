"""View models of the TUI: pure functions from a `Snapshot` (plus UI state) to rows and blocks.

No privilege, no Textual: every function here is unit-tested without an app. Cost is bounded by
what is on screen or expanded, never by the size of the tree, except `search_nodes`, `hotspots`
and `line_values` (one O(nodes) scan each).

The view models, in one place (the panes and the tests read them from here), by concern:
- tui/formatting.py: units, shares, bars, kind tags and colours;
- tui/treemodel.py: the tree's rows and the icicle's blocks, expansion keys, search, chain fitting;
- tui/codemodel.py: hotspots, per-line values and source excerpts (reads source files, bounded);
- tui/processes.py: the process list's rows;
- here: the windows, sorts, metric and view choice, advice findings and the status line.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable

from stacklens.cct import Frame, metrics
from stacklens.cct.labels import frame_text
from stacklens.cct.modelview import FULL, MODEL, has_model, model_view
from stacklens.tui.codemodel import (HOTSPOT_METRICS, Excerpt, Hotspot, context_of, hotspots, line_values,
                                     nearest_python, source_excerpt)
from stacklens.tui.formatting import (KIND_STYLE, SAMPLE_RATES, Snap, Unit, bar, fmt_share, fmt_value, kind_tag,
                                      metric_label, unit_of, window_label)
from stacklens.tui.processes import ProcessRow, cpu_shares, process_cells
from stacklens.tui.treemodel import (MAX_CHILDREN, SEP, Block, Key, Row, ancestor_keys, chain_item_text, fit_chain,
                                     hot_path_keys, icicle, row_index_of, row_index_of_key, search_nodes, tree_rows)

__all__ = [
    # formatting
    "KIND_STYLE", "SAMPLE_RATES", "Snap", "Unit", "bar", "fmt_share", "fmt_value", "frame_text", "kind_tag",
    "metric_label", "unit_of", "window_label",
    # the tree and the icicle
    "MAX_CHILDREN", "SEP", "Block", "Key", "Row", "ancestor_keys", "chain_item_text", "fit_chain", "hot_path_keys",
    "icicle", "row_index_of", "row_index_of_key", "search_nodes", "tree_rows",
    # hotspots and source
    "HOTSPOT_METRICS", "Excerpt", "Hotspot", "context_of", "hotspots", "line_values", "nearest_python",
    "source_excerpt",
    # the process list
    "ProcessRow", "cpu_shares", "process_cells",
    # here
    "WINDOWS", "SORTS", "PREFERRED_METRICS", "FULL", "MODEL", "default_metric", "measured_metrics", "next_metric",
    "shown_snapshot", "other_view", "Evidence", "Advice", "sort_advice", "advice_lines", "Status", "status_text",
]

WINDOWS: tuple[float | None, ...] = (None, 10.0, 60.0)
SORTS = ("inclusive", "exclusive", "name")
# Metric shown first: from the registry (cct/metrics.py).
PREFERRED_METRICS = metrics.PREFERRED


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


# ---- advice, status ------------------------------------------------------------------------


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
