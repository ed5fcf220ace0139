"""layout_conversions: copies that only change a tensor's layout or dtype (TenProf's
non-contiguous and redundant copies): `aten::contiguous`, `aten::clone`, `aten::copy_`,
`aten::_to_copy`, and copy / transpose / NCHW↔NHWC kernels, charged to the line that asked.

Host↔device copies are left to host_device_copies (a conversion with a memcpy API below it).
"""

from __future__ import annotations

from stacklens.cct import Frame, Snapshot

from stacklens.analyzer.config import RuleConfig
from stacklens.analyzer.finding import Finding, severity_for
from stacklens.analyzer.registry import rule
from stacklens.analyzer.view import name_matcher, op_base, view_of
from stacklens.analyzer.rules._common import (
    add_time_base, cost, guessed, is_memcpy_api, line_path, op_named, user_line,
)

# guessed, not measured (the finding says so): the share of the conversion time a fix removes
LAYOUT_SAVED = 0.9

RULE = "layout_conversions"

_conv_op = op_named("contiguous", "clone", "copy_", "_to_copy", "_reshape_copy", exact=(
    "to", "to_dtype", "to_device", "to_dtype_layout", "to_other"))
_copy_kernel = name_matcher(
    r"copy_kernel|direct_copy|copy_device_to_device|nchwtonhwc|nhwctonchw|transpose|permute|"
    r"elementwise_kernel.*copy|vectorized_elementwise_kernel.*copy"
)
_conv_like = name_matcher(r"conv|cudnn|batch_norm|pool")
# Copies LAPACK/cuSOLVER wrappers make into column-major scratch: not a layout the user chose.
_SCALAR = {"item", "_local_scalar_dense"}
_solver = name_matcher(r"linalg|lstsq|svd|qr|eig|cholesky|_lu|solve|inverse|det")


def _is_conversion(f: Frame) -> bool:
    return _conv_op(f) or (f.kind == "kernel" and _copy_kernel(f.name))


@rule(RULE)
def layout_conversions(snapshot: Snapshot, *, config: RuleConfig) -> list[Finding]:
    view = view_of(snapshot)
    min_share = config.param(RULE, "min_share", 0.03)
    marks = view.mark(_is_conversion, kinds=("op", "kernel"))
    frames = view.frames
    # Conversions that move data between host and device belong to host_device_copies.
    h2d = {marks[i] for i in range(view.n) if marks[i] and frames[i].kind == "gpu_api" and is_memcpy_api(frames[i].name)}
    # Which operators asked for each copy: the op frames between the line and the conversion.
    callers_of: dict[int, set[str]] = {}
    for h in {m for m in marks if m}:
        found, p = set(), view.parents[h]
        while p and frames[p].kind != "python":
            if frames[p].kind == "op":
                found.add(op_base(frames[p].name))
            p = view.parents[p]
        callers_of[h] = found
    # Copies made inside solvers (column-major scratch) or inside `.item()` (the scalar's copy to
    # the host, a sync_stalls matter) are not layouts the user chose.
    skip = h2d | {h for h, c in callers_of.items() if any(_solver(x) or x in _SCALAR for x in c)}
    nodes = [i for i, m in enumerate(marks) if m and m not in skip]
    metrics = ("cpu_samples", "py_samples", "gpu_time_ns", "kernel_count", "launch_count", "api_cpu_ns")
    groups = view.sum_by_line(nodes, metrics)
    heads: dict[int, set[int]] = {}
    for i in nodes:
        heads.setdefault(view.line[i], set()).add(marks[i])
    out = []
    for ln, acc in groups.items():
        share, ev = cost(view, acc)
        if share < min_share:
            continue
        hs = heads[ln]
        conv_names = sorted({frames[h].label() for h in hs})
        callers = set().union(*(callers_of[h] for h in hs))
        ev.update(view.unavailable_evidence("gpu_time_ns"))
        ev["conversion_sites"] = len(hs)
        add_time_base(view, ev)
        out.append(
            Finding(
                rule=RULE,
                severity=severity_for(share, 0.2, 0.07),
                path=line_path(view, ln, hs),
                title=f"layout/dtype conversion copies: {100 * share:.0f}% of the time in "
                + ", ".join(conv_names[:4])
                + (f" (inside {', '.join(sorted(callers)[:3])})" if callers else "")
                + (f", called from {user_line(view, ln)}" if user_line(view, ln) else ""),
                evidence=ev,
                fix=_fix(conv_names, callers) + guessed(LAYOUT_SAVED, "the conversion time"),
                estimated_saving=round(min(LAYOUT_SAVED * share, 0.9), 4),
            )
        )
    return out


def _fix(conv_names: list[str], callers: set[str]) -> str:
    text = " ".join(conv_names).lower()
    tips = []
    if any(_conv_like(c) for c in callers) or "nchw" in text or "nhwc" in text:
        tips.append(
            "the convolution converts its input or weight layout on every call: use one memory format "
            "end to end (`model.to(memory_format=torch.channels_last)` and "
            "`x = x.to(memory_format=torch.channels_last)` once, outside the loop)"
        )
    if "contiguous" in text or "reshape" in text or callers:
        tips.append(
            "a non-contiguous tensor (after transpose/permute/slicing) is copied to make it contiguous: "
            "produce it in the layout its consumer wants, transpose once outside the loop, or use an op "
            "that takes strided input (matmul/linear accept a transposed operand without a copy)"
        )
    if "clone" in text and not callers:
        tips.append("drop the clone() if the tensor is not modified afterwards")
    if "to" in text.replace("contiguous", ""):
        tips.append("convert dtype/layout once outside the loop (cast the model or the stored data)")
    return "; ".join(tips or ["avoid re-laying out the same data every step"]) + "."
