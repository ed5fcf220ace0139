"""fp32_gemm: matrix multiplies running in plain FP32 (SIMT) instead of on tensor cores.

Recognised from kernel names: `sgemm`, `gemm…f32f32`, cutlass `simt` kernels, without a
tensor-core marker (`tf32`, `bf16`, `f16`, `tensorop`, `hmma`, `h1688`, `s1688`…). One finding
for all of them (their lines listed); its saving comes from the step model (analyzer/step.py):
each kernel's GPU time x (1 - 1/TF32's speedup), the speedup measured for that kernel and size
class in the committed table (rules/_speedups.py, `gemm_speedups.json` in analyzer/data/), else
the guessed whole-step factor TF32_SPEEDUP, which the finding then names as a guess.
Without GPU time the launch counts still show they run, at low severity and no saving.
"""

from __future__ import annotations

from stacklens.cct import Snapshot

from stacklens.analyzer.config import RuleConfig
from stacklens.analyzer.finding import Finding, severity_for
from stacklens.analyzer.registry import rule
from stacklens.analyzer.step import step_of
from stacklens.analyzer.view import name_matcher, view_of
from stacklens.analyzer.rules._common import add_time_base, guessed, kernel, kernel_label, line_path, names, where
from stacklens.analyzer.rules._speedups import DEFAULT_TABLE, TABLE_NAME, SpeedupTable, load_table

RULE = "fp32_gemm"

_gemm = name_matcher(r"gemm|gemv|matmul")
_fp32 = name_matcher(r"sgemm|sgemv|f32f32|fp32|float|simt|_s\d*gemm")
_tensor_core = name_matcher(r"tf32|bf16|bfloat|f16|fp16|half|tensorop|hmma|imma|h\d{3,5}gemm|s(1688|16816|884)|wgmma|i8")


def is_fp32_gemm(name: str) -> bool:
    return bool(_gemm(name) and _fp32(name) and not _tensor_core(name))


# Guessed, not measured for GEMMs (the finding says so): the whole-step speedup of one fp32
# GPT-2-shaped training step on the H200 (47.65 ms fp32, 26.06 ms TF32; an issue's text, no script
# here), applied to GEMM time alone. Used for kernels the measured table has no row for.
TF32_SPEEDUP = 47.65 / 26.06
_GUESS_WHY = " (TF32's 1.83x on one fp32 GPT-2 training step, 47.65 -> 26.06 ms, applied to GEMM time alone)"


@rule(RULE)
def fp32_gemm(snapshot: Snapshot, *, config: RuleConfig) -> list[Finding]:
    """One finding for all fp32 GEMMs of the process, their lines listed; estimate: each kernel's
    GPU time x (1 - 1/speedup), as much of it as lies on the critical path (analyzer/step.py)."""
    view = view_of(snapshot)
    min_share = config.param(RULE, "min_share", 0.05)
    configured = "tf32_speedup" in config.rules.get(RULE, {})
    guess = config.param(RULE, "tf32_speedup", TF32_SPEEDUP)
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
    estimate = ""
    if has_gpu:
        gshare = gemm_ns / gpu_total if gpu_total else 0.0
        if gshare < min_share:
            return []
        table = None if configured else _table(config)
        saved_ns, measured_ns = _saved_ns(view, nodes, table, guess)
        speedup = gemm_ns / (gemm_ns - saved_ns) if gemm_ns > saved_ns else guess
        measured = measured_ns / gemm_ns if gemm_ns else 0.0
        ev.update(share_of_gpu_time=round(gshare, 4), tf32_speedup=round(speedup, 3), gpu_ns_saved=round(saved_ns),
                  tf32_measured_share=round(measured, 4))
        estimate = _estimate_text(speedup, measured, table, guess, configured)
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
        f"Lines: {lines}." + (estimate + (
            " (the GPU is idle most of the window here: faster GEMMs only lengthen its idle time)."
            if st is not None and st.busy_share < 0.5 else ".") if estimate else ""),
        estimated_saving=round(min(saving, 0.9), 4),
    )]


def _table(config: RuleConfig) -> SpeedupTable | None:
    """The measured table: `rules.fp32_gemm.speedup_table` (a path; '' for none), else the committed one."""
    path = config.param(RULE, "speedup_table", None)
    if path is None:
        return load_table(DEFAULT_TABLE, f"analyzer/data/{TABLE_NAME}")
    return load_table(path) if path else None


def _saved_ns(view, nodes: list[int], table: SpeedupTable | None, guess: float) -> tuple[float, float]:
    """GPU ns that TF32 saves over `nodes`, per kernel name (the table's factor for its kernel
    and time per launch, else `guess`), and the GEMM ns whose factor was measured."""
    gpu, count = view.col("gpu_time_ns"), view.col("kernel_count") or view.col("launch_count")
    per: dict[str, list[int]] = {}
    for i in nodes:
        e = per.setdefault(view.frames[i].name, [0, 0])
        e[0] += gpu[i] if gpu else 0
        e[1] += count[i] if count else 0
    saved = measured = 0.0
    for name, (ns, n) in per.items():
        m = table.tf32(name, ns / n if n else 0.0) if table is not None else None
        saved += ns * (1 - 1 / (m.speedup if m else guess))
        measured += ns if m else 0
    return saved, measured


def _estimate_text(speedup: float, measured: float, table: SpeedupTable | None, guess: float, configured: bool) -> str:
    """How the saving was estimated: from measured factors (the table named), the configured
    factor, or the guess, said to be one (`guessed`)."""
    tail = ", counted only where the GPU is on the critical path"
    if configured:
        return f" Estimate: these GEMMs' GPU time x (1 - 1/{guess:.2f}), the configured tf32_speedup" + tail
    if table is not None and measured >= 0.995:
        return (" Estimate: these GEMMs' GPU time x (1 - 1/TF32's speedup measured for each kernel and size, "
                f"{speedup:.2f}x over them: {table.source}, {table.device})" + tail)
    rest = f"the other {100 * (1 - measured):.0f}% of these GEMMs' GPU time" if measured else "these GEMMs' GPU time"
    text = guessed(1 - 1 / guess, rest).rstrip(".") + _GUESS_WHY
    if table is None:
        return text + tail
    if not measured:
        return text + f"; {table.source} has no row for these kernels" + tail
    return (f" Estimate: TF32's speedup measured for {100 * measured:.0f}% of these GEMMs' GPU time "
            f"({table.source}, {table.device});" + text[len(" Estimate:"):] + tail)
