"""fp32_gemm: matrix multiplies running in plain FP32 (SIMT) instead of on tensor cores.

Recognised from kernel names: `sgemm`, `gemm…f32f32`, cutlass `simt` kernels, without a
tensor-core marker (`tf32`, `bf16`, `f16`, `tensorop`, `hmma`, `h1688`, `s1688`…). GPU time
ranks them; without it the launch counts still show they run, at low severity and no saving.
"""

from __future__ import annotations

from stacklens.cct import Snapshot

from stacklens.analyzer.config import RuleConfig
from stacklens.analyzer.finding import Finding, severity_for
from stacklens.analyzer.registry import rule
from stacklens.analyzer.view import name_matcher, view_of
from stacklens.analyzer.rules._common import add_time_base, kernel, kernel_label, line_path, names

RULE = "fp32_gemm"

_gemm = name_matcher(r"gemm|gemv|matmul")
_fp32 = name_matcher(r"sgemm|sgemv|f32f32|fp32|float|simt|_s\d*gemm")
_tensor_core = name_matcher(r"tf32|bf16|bfloat|f16|fp16|half|tensorop|hmma|imma|h\d{3,5}gemm|s(1688|16816|884)|wgmma|i8")


def is_fp32_gemm(name: str) -> bool:
    return bool(_gemm(name) and _fp32(name) and not _tensor_core(name))


@rule(RULE)
def fp32_gemm(snapshot: Snapshot, *, config: RuleConfig) -> list[Finding]:
    view = view_of(snapshot)
    min_share = config.param(RULE, "min_share", 0.05)
    marks = view.mark(kernel(is_fp32_gemm), kinds=("kernel",))
    nodes = [i for i, m in enumerate(marks) if m]
    groups = view.sum_by_line(nodes, ("gpu_time_ns", "kernel_count", "launch_count"))
    has_gpu = view.col("gpu_time_ns") is not None
    gpu_total = view.totals.get("gpu_time_ns", 0)
    by_line: dict[int, list[int]] = {}
    for i in nodes:
        by_line.setdefault(view.line[i], []).append(i)
    out = []
    for ln, acc in groups.items():
        kn = names(view, by_line[ln])
        ev = {k: v for k, v in acc.items() if v}
        ev.update(view.unavailable_evidence("gpu_time_ns"))
        if has_gpu:
            gshare = acc.get("gpu_time_ns", 0) / gpu_total if gpu_total else 0.0
            if gshare < min_share:
                continue
            ev["share_of_gpu_time"] = round(gshare, 4)
            share = view.gpu_share(acc.get("gpu_time_ns", 0))
            saving = 0.5 * share
            severity = severity_for(gshare, 0.3, 0.1)
        else:
            if not (acc.get("kernel_count") or acc.get("launch_count")):
                continue
            saving, severity = 0.0, "low"
        add_time_base(view, ev)
        out.append(
            Finding(
                rule=RULE,
                severity=severity,
                path=line_path(view, ln, by_line[ln][0]),
                title="FP32 GEMM not on tensor cores: " + ", ".join(kernel_label(n, 64) for n in kn[:3]),
                evidence=ev,
                fix="Let matmuls use tensor cores: `torch.set_float32_matmul_precision('high')` (TF32; "
                "`torch.backends.cudnn.allow_tf32 = True` for convolutions), or run the model under "
                "`torch.autocast('cuda', dtype=torch.bfloat16)`; check the accuracy you need first.",
                estimated_saving=round(min(saving, 0.9), 4),
            )
        )
    return out
