"""hotspots: where the time goes, by Python line, exclusive and inclusive, CPU and GPU.

Exclusive: a line's own cost (its operators, native frames, kernels; not the Python lines it
calls). Inclusive: a function whose callees together are hot although no single line is.
Informational: estimated_saving is 0; the evidence names the operator or kernel that dominates.
"""

from __future__ import annotations

from stacklens.cct import Snapshot

from stacklens.analyzer.config import RuleConfig
from stacklens.analyzer.finding import Finding
from stacklens.analyzer.registry import rule
from stacklens.analyzer.view import CPU_METRICS, View, view_of
from stacklens.analyzer.rules._common import add_time_base, kernel_label, short

RULE = "hotspots"


def _line_self(view: View, col: list[int]) -> tuple[dict[int, int], dict[tuple[int, int], int]]:
    """Cost per line, and per (line, first op or kernel below it)."""
    frames, parents, line = view.frames, view.parents, view.line
    top = [0] * view.n
    for i in range(1, view.n):
        k = frames[i].kind
        if k == "python":
            continue
        up = top[parents[i]]
        top[i] = up if up else (i if k in ("op", "kernel") else 0)
    per_line: dict[int, int] = {}
    per_top: dict[tuple[int, int], int] = {}
    for i, v in enumerate(col):
        if v:
            per_line[line[i]] = per_line.get(line[i], 0) + v
            key = (line[i], top[i])
            per_top[key] = per_top.get(key, 0) + v
    return per_line, per_top


def _inclusive(view: View, col: list[int]) -> list[int]:
    acc = list(col)
    parents = view.parents
    for i in range(view.n - 1, 0, -1):
        acc[parents[i]] += acc[i]
    return acc


@rule(RULE)
def hotspots(snapshot: Snapshot, *, config: RuleConfig) -> list[Finding]:
    view = view_of(snapshot)
    min_share = config.param(RULE, "min_share", 0.10)
    incl_share = config.param(RULE, "inclusive_min_share", 0.30)
    top_k = int(config.param(RULE, "top_k", 5))
    out: list[Finding] = []

    sources = []
    # BPF CPU samples (on-CPU) and the agent's Python samples (wall clock) are ranked apart:
    # they count different things, and today only the latter carry Python lines.
    for metric in CPU_METRICS:
        if view.col(metric):
            sources.append(("CPU" if metric == "cpu_samples" else "Python (wall)", metric, view.totals[metric]))
    if view.col("gpu_time_ns"):
        sources.append(("GPU", "gpu_time_ns", view.totals["gpu_time_ns"]))
    missing = view.unavailable_evidence("gpu_time_ns", "cpu_samples")

    for where, metric, total in sources:
        col = view.col(metric)
        assert col is not None
        per_line, reported, found = _exclusive(view, col, where, metric, total, missing, min_share, top_k)
        out += found
        out += _inclusive_findings(view, col, where, metric, total, missing, incl_share, top_k, per_line, reported)
    return out


def _exclusive(view, col, where: str, metric: str, total, missing: dict, min_share: float, top_k: int):
    """The lines whose own cost is the largest (the top `top_k` over `min_share`): (each line's
    own cost, the lines reported, their findings)."""
    found: list[Finding] = []
    per_line, per_top = _line_self(view, col)
    tops: dict[int, tuple[int, int]] = {}
    for (ln, top), v in per_top.items():
        if top and v > tops.get(ln, (0, 0))[1]:
            tops[ln] = (top, v)
    ranked = sorted(per_line.items(), key=lambda kv: -kv[1])
    reported = set()
    for ln, v in ranked[:top_k]:
        share = v / total
        if share < min_share:
            break
        reported.add(ln)
        ev = {metric: v, f"share_of_{metric}": round(share, 4), **missing}
        add_time_base(view, ev)
        # GPU time is never the Python line's own: without a dominant op it is spread.
        what = "several operators" if metric == "gpu_time_ns" or not ln else "its own Python code"
        if ln in tops:
            top, tv = tops[ln]
            ev["top_frame_share_of_line"] = round(tv / v, 4)
            if tv * 2 >= v:
                tf = view.frames[top]
                what = f"kernel {kernel_label(tf.name)}" if tf.kind == "kernel" else tf.label()
        found.append(
            Finding(
                rule=RULE,
                severity="medium" if share >= 0.5 else "low",  # informational: ranks below fixes
                # No Python frame above the cost (BPF stacks without Python): the op or kernel.
                path=view.labels(ln) if ln else (view.labels(tops[ln][0]) if ln in tops else ()),
                title=f"{where} hotspot (exclusive): {100 * share:.0f}% of {metric} "
                + (f"at this line, mostly {short(what)}" if ln else f"in {short(what)} (these stacks carry no Python frames)"),
                evidence=ev,
                fix=f"This line's own work is the largest {where} cost. "
                f"Check whether {short(what)} must run every step, runs at the right size and dtype, "
                "and see the other findings for this path.",
            )
        )
    return per_line, reported, found


def _inclusive_findings(view, col, where: str, metric: str, total, missing: dict, incl_share: float, top_k: int,
                        per_line: dict, reported: set) -> list[Finding]:
    """Calls whose callees together are hot though no line below them dominates."""
    found: list[Finding] = []
    incl = _inclusive(view, col)
    frames, parents, line = view.frames, view.parents, view.line
    hot_child_of: set[int] = set()
    for i in range(1, view.n):
        if frames[i].kind == "python" and incl[i] >= incl_share * total:
            hot_child_of.add(line[parents[i]])
    cands = [
        i
        for i in range(1, view.n)
        if frames[i].kind == "python"
        and incl[i] >= incl_share * total
        and i not in hot_child_of
        and i not in reported
    ]
    cands.sort(key=lambda i: -incl[i])
    for i in cands[:top_k]:
        share = incl[i] / total
        own = per_line.get(i, 0)
        ev = {f"inclusive_{metric}": incl[i], f"share_of_{metric}": round(share, 4),
              f"exclusive_{metric}": own, **missing}
        found.append(
            Finding(
                rule=RULE,
                severity="low",
                path=view.labels(i),
                title=f"{where} hotspot (inclusive): {100 * share:.0f}% of {metric} under this call, spread over its callees",
                evidence=ev,
                fix="No single line below dominates: profile this function's callees together "
                "(torch.compile of the whole function, or fewer calls with larger batches).",
            )
        )
    return found
