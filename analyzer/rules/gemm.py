"""fp32_gemm: matrix multiplies running in plain FP32 (SIMT) instead of on tensor cores.

Recognised from kernel names: `sgemm`, `gemm…f32f32`, cutlass `simt` kernels, without a
tensor-core marker (`tf32`, `bf16`, `f16`, `tensorop`, `hmma`, `h1688`, `s1688`…). One finding
for all of them (their lines listed); its saving comes from the step model (analyzer/step.py).
Without GPU time the launch counts still show they run, at low severity and no saving.
"""

from __future__ import annotations

from stacklens.cct import Snapshot

from stacklens.analyzer.config import RuleConfig
from stacklens.analyzer.finding import Finding, severity_for
from stacklens.analyzer.registry import rule
from stacklens.analyzer.step import step_of
from stacklens.analyzer.view import name_matcher, view_of
from stacklens.analyzer.rules._common import add_time_base, kernel, kernel_label, line_path, names, where

RULE = "fp32_gemm"

_gemm = name_matcher(r"gemm|gemv|matmul")
_fp32 = name_matcher(r"sgemm|sgemv|f32f32|fp32|float|simt|_s\d*gemm")
_tensor_core = name_matcher(r"tf32|bf16|bfloat|f16|fp16|half|tensorop|hmma|imma|h\d{3,5}gemm|s(1688|16816|884)|wgmma|i8")


def is_fp32_gemm(name: str) -> bool:
    return bool(_gemm(name) and _fp32(name) and not _tensor_core(name))


# TF32's speedup of fp32 GEMMs, from a measured step: the same kind of job as issue 29's (fp32
# GPT-2-shaped training on the H200) ran its step in 47.65 ms in fp32 and 26.06 ms with TF32
# matmuls, 1.83x. The step also held work TF32 does not touch, so the GEMMs alone sped up at
# least that much: applied to GEMM time only, the estimate errs low, not high.
TF32_SPEEDUP = 47.65 / 26.06


@rule(RULE)
def fp32_gemm(snapshot: Snapshot, *, config: RuleConfig) -> list[Finding]:
    """One finding for all fp32 GEMMs of the process, their lines listed; estimate: their GPU
    time x (1 - 1/speedup), as much of it as lies on the critical path (analyzer/step.py)."""
    view = view_of(snapshot)
    min_share = config.param(RULE, "min_share", 0.05)
    speedup = config.param(RULE, "tf32_speedup", TF32_SPEEDUP)
    marks = view.mark(kernel(is_fp32_gemm), kinds=("kernel",))
    nodes = [i for i, m in enumerate(marks) if m]
    if not nodes:
        return []
    metrics = ("gpu_time_ns", "kernel_count", "launch_count")
    groups = view.sum_by_line(nodes, metrics)
    acc = {m: sum(g.get(m, 0) for g in groups.values()) for m in metrics}
    has_gpu = view.col("gpu_time_ns") is not None
    gpu_total = view.totals.get("gpu_time_ns", 0)
    gemm_ns = acc.get("gpu_time_ns", 0)
    ev = {k: v for k, v in acc.items() if v}
    ev.update(view.unavailable_evidence("gpu_time_ns"))
    by_line: dict[int, list[int]] = {}
    for i in nodes:
        by_line.setdefault(view.line[i], []).append(i)
    st = step_of(view)
    if has_gpu:
        gshare = gemm_ns / gpu_total if gpu_total else 0.0
        if gshare < min_share:
            return []
        saved_ns = gemm_ns * (1 - 1 / speedup)
        ev.update(share_of_gpu_time=round(gshare, 4), tf32_speedup=round(speedup, 3), gpu_ns_saved=round(saved_ns))
        if st is not None:
            ev.update(st.evidence())
            saving = st.gpu_saving(saved_ns)
        else:
            ev["wall_ns_unavailable"] = 1.0
            saving = 0.0
        severity = severity_for(saving, 0.15, 0.05)
    elif acc.get("kernel_count") or acc.get("launch_count"):
        saving, severity = 0.0, "low"
    else:
        return []
    add_time_base(view, ev)
    per_name: dict[str, list[int]] = {}   # one entry per source line, however many contexts call it
    for ln, g in groups.items():
        e = per_name.setdefault(where(view.frames[ln]) if ln else "(no Python frame)", [0, 0, ln])
        e[0] += g.get("gpu_time_ns", 0)
        e[1] += g.get("kernel_count", 0) or g.get("launch_count", 0)
    ranked = sorted(per_name.items(), key=lambda kv: (-kv[1][0], -kv[1][1]))
    top = max(groups, key=lambda ln: (groups[ln].get("gpu_time_ns", 0), groups[ln].get("kernel_count", 0)))
    lines = "; ".join(f"{name}: {e[0] / 1e6:.1f} ms, {e[1]} kernels" for name, e in ranked[:8])
    kn = names(view, nodes)
    return [Finding(
        rule=RULE,
        severity=severity,
        path=line_path(view, top, by_line[top][0]),
        title=f"FP32 GEMMs not on tensor cores ({len(kn)} kernels, {gemm_ns / 1e6:.0f} ms of GPU time, "
        f"{len(per_name)} lines): " + ", ".join(kernel_label(n, 64) for n in kn[:3]),
        evidence=ev,
        fix="Let matmuls use tensor cores: `torch.set_float32_matmul_precision('high')` (TF32; "
        "`torch.backends.cudnn.allow_tf32 = True` for convolutions), or run the model under "
        "`torch.autocast('cuda', dtype=torch.bfloat16)`; check the accuracy you need first. "
        f"Lines: {lines}. Estimate: these GEMMs' GPU time x (1 - 1/{speedup:.2f}) (TF32 on an H200: "
        "a fp32 training step 47.65 -> 26.06 ms), counted only where the GPU is on the critical path"
        + (" (the GPU is idle most of the window here: faster GEMMs only lengthen its idle time)."
           if st is not None and st.busy_share < 0.5 else "."),
        estimated_saving=round(min(saving, 0.9), 4),
    )]

