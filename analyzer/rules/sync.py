"""sync_stalls: `.item()`, `.cpu()`, `.tolist()`, `torch.cuda.synchronize()` in the loop.

Evidence: sync_wait_ns under the line's sync APIs (cuStreamSynchronize, cuCtxSynchronize,
blocking device-to-host copies…) and the CPU time of the operators that force a sync
(`aten::item`, `aten::_local_scalar_dense`, `aten::nonzero`, `aten::is_nonzero`…), which is
what a CPU-only process shows of the same pattern.
"""

from __future__ import annotations

from stacklens.cct import Frame, Snapshot

from stacklens.analyzer.config import RuleConfig
from stacklens.analyzer.finding import Finding, severity_for
from stacklens.analyzer.registry import rule
from stacklens.analyzer.step import step_of
from stacklens.analyzer.view import name_matcher, op_base, op_of_native, view_of
from stacklens.analyzer.rules._common import (
    add_time_base, cost, guessed, is_sync_api, line_path, names, op_named,
)

# guessed, not measured (the finding says so): the share of a sync wait a fix removes where the
# step model cannot say (no GPU time)
SYNC_SAVED = 0.8

RULE = "sync_stalls"

is_sync_op = op_named("item", "_local_scalar_dense", "is_nonzero", "nonzero", "equal", "masked_select", "unique")
_EXTRACT_OPS = ("select", "slice", "unbind", "index", "as_strided", "squeeze", "view")
_EXTRACT_PREFIXES = tuple(b + "_" for b in _EXTRACT_OPS)
_htod = name_matcher(r"htod")
_blocking_dtoh = name_matcher(r"memcpy.*dtoh(?!.*async)|^cudaMemcpy$|^cuMemcpy$")


def _is_extract_frame(f: Frame) -> bool:
    """An op that picks elements: its op frame when the op is probed, else its
    `at::_ops::<op>::call` frame in the native stack. View ops (select_int, slice_Tensor,
    as_strided, view, squeeze…) are not probed by default (stacklens.bpf.ops.VIEW_OPS), so a
    sample inside `probs[i]` reads py line → native …select_int::call → … with no op frame.
    Names match as in `op_named`: the base or the base with an overload suffix."""
    op = f.name if f.kind == "op" else op_of_native(f.name) if f.kind == "native" else None
    if op is None:
        return False
    base = op_base(op)
    return base in _EXTRACT_OPS or base.startswith(_EXTRACT_PREFIXES)


def _is_sync_frame(f) -> bool:
    return is_sync_op(f) or (f.kind == "gpu_api" and (is_sync_api(f.name) or _blocking_dtoh(f.name)))


@rule(RULE)
def sync_stalls(snapshot: Snapshot, *, config: RuleConfig) -> list[Finding]:
    view = view_of(snapshot)
    min_share = config.param(RULE, "min_share", 0.05)
    frames, line = view.frames, view.line
    marks = view.mark(_is_sync_frame, kinds=("op", "gpu_api"))
    wait = view.col("sync_wait_ns")
    htod = view.mark(lambda f: _htod(f.name), kinds=("gpu_api",))
    nodes = [i for i, m in enumerate(marks) if m]
    # Sync waits recorded anywhere under a line count, even below an op that is not a sync op
    # (`.cpu()` is aten::_to_copy → copy_ → cuMemcpyDtoH…); waits of host→device copies are
    # host_device_copies' business.
    if wait:
        nodes.extend(i for i, v in enumerate(wait) if v and not marks[i] and not htod[i])
    sync_lines = {line[i] for i in nodes}
    # Around a per-element `.item()` loop the cost is the loop itself: the indexing that picks
    # each element and the interpreter running the line. Both go away when it is vectorised.
    # At a Python line that is the line's own time and what runs under it outside any probed op
    # (the C extension's glue, unprobed view ops, native stacks cut above their op's entry);
    # without Python frames (line 0: the whole process) only the element-picking ops count.
    extract = view.mark(_is_extract_frame, kinds=("op", "native"))
    in_op = view.mark(lambda f: True, kinds=("op",))
    cm = view.cpu_metric
    col = view.col(cm) if cm else None
    if col:
        nodes.extend(
            i for i in range(1, view.n)
            if col[i] and not marks[i] and line[i] in sync_lines and (extract[i] or (line[i] and not in_op[i]))
        )
    metrics = ("cpu_samples", "py_samples", "sync_wait_ns", "api_cpu_ns", "copy_bytes")
    groups = view.sum_by_line(nodes, metrics)
    by_line: dict[int, list[int]] = {}
    for i in nodes:
        if marks[i] or (wait and wait[i]):
            by_line.setdefault(line[i], []).append(marks[i] or i)
    out = []
    st = step_of(view)
    for ln, acc in groups.items():
        if ln not in by_line:
            continue
        share, ev = cost(view, acc)
        if share < min_share:
            continue
        # The step model (analyzer/step.py): a wait stalls the step only where the GPU went idle
        # behind it: wait x the GPU's idle share, at most the idle time; little on a GPU-bound job.
        saving, severity = SYNC_SAVED * share, severity_for(share, 0.2, 0.05)
        if st is not None and view.has("sync_wait_ns"):
            saving = st.sync_saving(acc.get("sync_wait_ns", 0))
            severity = severity_for(saving, 0.2, 0.05)
            ev.update(st.evidence())
        frames_here = names(view, set(by_line[ln]))
        ev.update(view.unavailable_evidence("sync_wait_ns", "gpu_time_ns"))
        if acc.get("sync_wait_ns") and view.wall_ns:
            ev["wait_share"] = round(view.ns_share(acc["sync_wait_ns"]), 4)
        add_time_base(view, ev)
        out.append(
            Finding(
                rule=RULE,
                severity=severity,
                path=line_path(view, ln, set(by_line[ln])),
                title=f"synchronization in the loop: {100 * share:.0f}% of the time at a line calling "
                + ", ".join(frames_here[:4]),
                evidence=ev,
                fix=_fix(frames_here) + (_model_text(st) if st is not None else guessed(SYNC_SAVED, "the wait")),
                estimated_saving=round(min(saving, 0.9), 4),
            )
        )
    return out


def _model_text(st) -> str:
    if st is None:
        return ""
    return (f" Estimate: the wait x the GPU's idle share ({100 * (1 - st.busy_share):.0f}% of the window), at "
            "most the idle time: a sync costs the step only where the GPU went idle behind it.")


def _fix(frames_here: list[str]) -> str:
    text = " ".join(frames_here).lower()
    tips = []
    if "item" in text or "scalar" in text:
        tips.append(
            "`.item()` copies one value to the host and waits for all queued work: keep values on "
            "the device (accumulate `total += loss.detach()`), read them once every N steps, or "
            "vectorise a per-element `.item()` loop into one tensor operation"
        )
    if "memcpy" in text or "dtoh" in text:
        tips.append(
            "`.cpu()`/`.tolist()`/`.numpy()` block until the GPU is done: move the result with "
            "`.to('cpu', non_blocking=True)` into pinned memory and wait on a CUDA event only where it is used"
        )
    if "nonzero" in text or "masked_select" in text or "unique" in text or "is_nonzero" in text:
        tips.append(
            "data-dependent shapes (nonzero, boolean masks, `if tensor:`) force a sync: use "
            "torch.where / masked arithmetic with static shapes"
        )
    if "synchroni" in text:
        tips.append("remove torch.cuda.synchronize() from the loop (time with CUDA events instead)")
    tips.append("torch.cuda.set_sync_debug_mode('warn') reports each sync with its line")
    return "; ".join(tips) + "."
