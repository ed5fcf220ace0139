"""Plain-text rendering of a CCT snapshot: the `text` report format and the non-TTY live view.

No privilege; pure formatting over a `Snapshot`. Frame labels and meta values are printed through
`safe_text` (control characters escaped): the daemon escapes target strings where they enter, but a
report may render a snapshot file from anywhere.
"""

from __future__ import annotations

from stacklens.cct import Snapshot, metrics
from stacklens.cct.labels import frame_text
from stacklens.cct.modelview import MODEL
from stacklens.textsafe import safe_text


NOTE_MAX = 200   # characters of a note the text report and the CLI print whole


def short_note(note: str, pid: object = None, limit: int = NOTE_MAX) -> str:
    """`note` as text output prints it: whole up to `limit` characters; a longer one (the list of
    every probed driver symbol) cut after the items of its list ("; " or ", " apart) that fit, or
    after `limit` characters, saying how many more there are and where the whole is (JSON output
    keeps every note whole; `stacklens doctor --pid PID` lists the probed symbols)."""
    if len(note) <= limit:
        return note
    where = f"`stacklens doctor --pid {pid if pid is not None else 'PID'}` or --json"
    for sep in ("; ", ", "):
        items = note.split(sep)
        if len(items) > 2 and len(items[0]) <= limit:
            kept = 1
            while len(sep.join(items[:kept + 1])) <= limit:
                kept += 1
            return f"{sep.join(items[:kept])}… ({len(items) - kept} more: {where})"
    return f"{note[:limit]}… ({len(note) - limit} more characters: {where})"


def fmt_value(metric: str, value: int) -> str:
    """Human units from the registry (cct/metrics.py); counts as exact integers."""
    return metrics.fmt_value(metric, value, exact=True)


def render_tree(
    snap: Snapshot,
    metric: str,
    *,
    max_depth: int = 40,
    min_share: float = 0.01,
    max_children: int = 8,
    width: int = 160,
) -> str:
    """Indented tree by inclusive `metric`, hiding children under `min_share` of the total.

    Single-child chains are shown as they are (one line per frame) so every label stays readable.
    """
    if metric in snap.unavailable:
        return f"{metric}: unavailable for this process (not measured; see `stacklens doctor`)\n"
    total = snap.inclusive(snap.root, metric)
    lines = [f"{metric}: total {fmt_value(metric, total)}   (incl / excl / share / frame)"]
    if total == 0:
        lines.append("  (no samples yet)")
        return "\n".join(lines) + "\n"

    def walk(node: int, depth: int) -> None:
        kids = sorted(
            snap.children(node), key=lambda c: snap.inclusive(c, metric), reverse=True
        )
        shown = 0
        for child in kids:
            incl = snap.inclusive(child, metric)
            if incl == 0 or incl / total < min_share or shown >= max_children:
                continue
            shown += 1
            excl = snap.exclusive(child, metric)
            label = safe_text(frame_text(snap.frame_of(child), full=True))
            row = (
                f"{fmt_value(metric, incl):>10} {fmt_value(metric, excl):>10} "
                f"{100.0 * incl / total:5.1f}% {'  ' * depth}{label}"
            )
            lines.append(row[:width])
            if depth + 1 < max_depth:
                walk(child, depth + 1)

    walk(snap.root, 0)
    return "\n".join(lines) + "\n"


def window_line(w: dict) -> str:
    """A one-shot profile's window account (meta["window"], cli/oneshot.py) on one line: the report
    header shows it and `stacklens profile` / `record` print it on stderr."""
    late = w.get("events_late")
    return (f"window: {w['seconds']:.2f}s (monotonic {w['start_ns']}..{w['end_ns']} ns), target CPU "
            f"{'unknown' if w.get('target_cpu_s') is None else format(w['target_cpu_s'], '.2f') + 's'}, "
            f"cpu_samples {w.get(metrics.CPU_SAMPLES, 0)} ({_due(w)} at "
            f"{w.get('cpu_hz')} Hz), events dropped {w.get('events_dropped', 0)}, late "
            f"{('unknown' if w.get('drained', True) else 'unknown (not drained)') if late is None else late}, "
            f"unjoined {w.get('unjoined', 0)}"
            + (f", calls cut at the end {w['cut_at_end']}" if w.get("cut_at_end") else "")
            + (f", syncs still waiting at the end {w['in_flight_at_end']} (counted up to it)"
               if w.get("in_flight_at_end") else ""))


def _due(w: dict) -> str:
    due = w.get("expected_cpu_samples")
    return "due unknown" if due is None else f"due ≈{due}"


def render_report(snap: Snapshot, metric: str, **kw) -> str:
    """Header with process meta and per-metric totals, then the tree for `metric`."""
    meta = snap.meta or {}
    head = []
    if meta:
        head.append(safe_text(
            "  ".join(f"{k}={meta[k]}" for k in sorted(meta)
                      if not isinstance(meta[k], (dict, list)) and not k.startswith("view"))
        ))
    if meta.get("view") == MODEL:
        head.append(f"model view: module calls named, framework frames (module call wrappers, decorators, "
                    f"dynamo: cct/modelview.py) collapsed in {meta.get('view_collapsed_nodes', 0)} contexts; "
                    "--view full shows them")
    win = meta.get("window")
    if isinstance(win, dict) and win.get("end_ns"):   # a one-shot profile's account (cli/oneshot.py)
        head.append(window_line(win))
    head.extend(safe_text(f"note: {short_note(n, meta.get('pid'))}") for n in meta.get("notes") or []
                if isinstance(n, str))
    totals = []
    for m in snap.metrics:
        if m in snap.unavailable:
            totals.append(f"{m}=unavailable")
        else:
            totals.append(f"{m}={fmt_value(m, snap.total(m))}")
    head.append("totals: " + "  ".join(totals))
    if snap.folded_nodes:
        head.append(f"folded into [other]: {snap.folded_nodes} contexts (node cap or memory budget)")
    mem = meta.get("memory")
    if isinstance(mem, dict) and (mem.get("budget_folded_nodes") or mem.get("evicted_buckets")):
        budget = metrics.fmt_quantity(metrics.BYTES, int(mem.get("budget_bytes", 0)))
        head.append(f"memory budget {budget} reached: "
                    f"{mem.get('budget_folded_nodes', 0)} contexts folded into [other], "
                    f"{mem.get('evicted_buckets', 0)} window buckets dropped early")
    return "\n".join(head) + "\n\n" + render_tree(snap, metric, **kw)
