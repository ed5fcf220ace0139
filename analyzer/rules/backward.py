"""backward_cost: backward work charged to the forward line that created it, where it is out
of proportion to that line's forward.

Needs the forward→backward link in the tree: backward frames (`backward:XBackward0`, as the
daemon's backward link writes them, or `autograd::engine::evaluate_function: XBackward0` /
`XBackward0` from other recorders) under the *forward* Python line (joined through autograd
sequence numbers, as DeepContext does). Backward frames found only under `loss.backward()` carry no such
link; the rule then says so instead of guessing.
"""

from __future__ import annotations

from stacklens.cct import Frame, Snapshot

from stacklens.analyzer.config import RuleConfig
from stacklens.analyzer.finding import Finding, severity_for
from stacklens.analyzer.registry import rule
from stacklens.analyzer.view import name_matcher, view_of
from stacklens.analyzer.rules._common import add_time_base, cost, line_path, user_line

RULE = "backward_cost"

_bwd = name_matcher(r"Backward\d*$|^autograd::engine::evaluate_function")


def _is_backward(f: Frame) -> bool:
    return f.kind == "backward" or (f.kind in ("op", "other", "native") and _bwd(f.name))


def _is_backward_call(f: Frame) -> bool:
    return f.kind == "python" and f.name in ("backward", "_engine_run_backward", "run_backward")


@rule(RULE)
def backward_cost(snapshot: Snapshot, *, config: RuleConfig) -> list[Finding]:
    view = view_of(snapshot)
    min_share = config.param(RULE, "min_share", 0.15)
    min_ratio = config.param(RULE, "min_ratio", 3.0)
    normal_ratio = config.param(RULE, "normal_ratio", 2.0)
    frames = view.frames
    marks = view.mark(_is_backward, kinds=("backward", "op", "other", "native"))
    metrics = ("cpu_samples", "py_samples", "gpu_time_ns")
    cost_nodes = view.nodes_with_value(metrics)
    bwd_nodes = [i for i in cost_nodes if marks[i]]
    bwd = view.sum_by_line(bwd_nodes, metrics)
    fwd = view.sum_by_line([i for i in cost_nodes if not marks[i]], metrics)
    names_by_line: dict[int, dict[str, int]] = {}
    for i in bwd_nodes:
        d = names_by_line.setdefault(view.line[i], {})
        name = frames[marks[i]].name.rpartition(": ")[2]
        d[name] = d.get(name, 0) + 1
    out = []
    for ln, bacc in bwd.items():
        if not ln or _is_backward_call(frames[ln]):
            continue  # no forward link for this backward work
        bshare, bev = cost(view, bacc)
        if bshare < min_share:
            continue
        fshare, _ = cost(view, fwd.get(ln, {}))
        ratio = bshare / fshare if fshare else float("inf")
        if ratio < min_ratio:
            continue
        ev = {f"backward_{k}": v for k, v in bev.items()}
        ev["forward_share"] = round(fshare, 4)
        ev["backward_share"] = round(bshare, 4)
        if fshare:
            ev["backward_to_forward"] = round(ratio, 2)
        ev.update(view.unavailable_evidence("gpu_time_ns"))
        add_time_base(view, ev)
        top = sorted(names_by_line[ln], key=lambda k: -names_by_line[ln][k])[:3]
        out.append(
            Finding(
                rule=RULE,
                severity=severity_for(bshare, 0.25, 0.1),
                path=line_path(view, ln, ln),
                title=(f"backward of this line costs {ratio:.1f}x its forward" if fshare else
                       "backward of this line is all its cost (its forward is too small to register)")
                + f": {100 * bshare:.0f}% of the time, in {', '.join(top)}" + _called_from(view, ln),
                evidence=ev,
                fix=_fix(top) + f" Estimate: the backward time beyond {normal_ratio:g}x its forward — a guessed "
                "'normal' ratio, not yet checked against the speedup of applying the fix.",
                estimated_saving=round(min(max(bshare - normal_ratio * fshare, 0.0), 0.9), 4),
            )
        )
    return out


def _called_from(view, ln: int) -> str:
    where = user_line(view, ln)
    return f" (called from {where})" if where else ""


def _fix(top: list[str]) -> str:
    text = " ".join(top).lower()
    if "embedding" in text:
        return ("The embedding's gradient is dense over the whole table: use nn.Embedding(..., sparse=True) "
                "with an optimizer that takes sparse gradients (SGD, SparseAdam), or freeze rows that do not train.")
    if "index" in text or "scatter" in text or "gather" in text:
        return ("Indexing backward accumulates with index_put_/scatter_add (serialised on duplicates): "
                "gather with torch.gather/index_select, or restructure so indices are unique.")
    if "repeat" in text or "expand" in text:
        return "The gradient of repeat/expand sums over the copies: broadcast instead of materialising repeats."
    return ("This line's backward dominates: look for an operator with an expensive gradient and prefer one "
            "with a cheap one; recompute (torch.utils.checkpoint) only where memory requires it.")
