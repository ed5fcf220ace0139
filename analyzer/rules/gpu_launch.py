"""kernel_fusion and launch_bound: one Python line launching many small kernels; a GPU idle most
of the window while the process launches many small kernels (the step model, analyzer/step.py);
and lines whose launch API CPU time is not covered by the GPU time of what they launch.

Needs launch data (BPF on the GPU API); GPU time (agent) sharpens both. Without it the rules
still count launches and API CPU time, and say gpu_time_ns was unavailable.
"""

from __future__ import annotations

from stacklens.cct import Snapshot

from stacklens.analyzer.config import RuleConfig
from stacklens.analyzer.finding import Finding, severity_for
from stacklens.analyzer.registry import rule
from stacklens.analyzer.step import step_of
from stacklens.analyzer.view import View, view_of
from stacklens.analyzer.rules._common import (
    add_time_base, api, is_launch_api, is_unnamed_kernel, kernel_label, line_path,
)
from stacklens.analyzer.rules.idle import idle_finding

FUSION = "kernel_fusion"
LAUNCH = "launch_bound"


def _per_line_kernels(view: View) -> dict[int, dict]:
    """Per Python line: kernels by name (launches, gpu ns) and API CPU ns of launch calls."""
    return view.memo("per_line_kernels", lambda: _compute_per_line_kernels(view))  # type: ignore[return-value]


def _compute_per_line_kernels(view: View) -> dict[int, dict]:
    frames, line = view.frames, view.line
    kc = view.col("kernel_count") or view.col("launch_count")
    lc = view.col("launch_count") or kc
    gpu = view.col("gpu_time_ns")
    api_ns = view.col("api_cpu_ns")
    in_launch = view.mark(api(is_launch_api), kinds=("gpu_api",))
    out: dict[int, dict] = {}
    for i in range(1, view.n):
        f = frames[i]
        a = api_ns[i] if api_ns and in_launch[i] else 0
        if f.kind != "kernel" and not a:
            continue
        g = out.setdefault(line[i], {"kernels": {}, "api_cpu_ns": 0, "node": i, "unnamed": 0})
        g["api_cpu_ns"] += a
        if is_unnamed_kernel(f):   # a handle, not a kernel: its launches are counted, never named
            g["unnamed"] += (lc[i] if lc else 0) or (kc[i] if kc else 0)
        elif f.kind == "kernel":
            k = g["kernels"].setdefault(f.name, [0, 0, 0])
            k[0] += (lc[i] if lc else 0)
            k[1] += (gpu[i] if gpu else 0)
            k[2] += (kc[i] if kc else 0)
    return out


@rule(FUSION)
def kernel_fusion(snapshot: Snapshot, *, config: RuleConfig) -> list[Finding]:
    view = view_of(snapshot)
    min_distinct = int(config.param(FUSION, "min_distinct_kernels", 3))
    min_launches = int(config.param(FUSION, "min_launches", 30))
    small_ns = config.param(FUSION, "small_kernel_ns", 20_000.0)
    min_share = config.param(FUSION, "min_share", 0.02)
    has_gpu = view.col("gpu_time_ns") is not None
    total_launches = view.totals.get("launch_count") or view.totals.get("kernel_count") or 0
    out = []
    for ln, g in _per_line_kernels(view).items():
        kernels = g["kernels"]
        launches = sum(k[0] or k[2] for k in kernels.values()) + g["unnamed"]
        gpu_ns = sum(k[1] for k in kernels.values())
        if len(kernels) < min_distinct or launches < min_launches:
            continue
        small = {n: k for n, k in kernels.items() if not has_gpu or (k[1] / max(1, k[0] or k[2])) < small_ns}
        if len(small) < min_distinct:
            continue
        api_ns = g["api_cpu_ns"]
        launch_share = launches / total_launches if total_launches else 0.0
        time_share = max(view.ns_share(api_ns), view.gpu_share(gpu_ns) if has_gpu else 0.0)
        if max(time_share, launch_share) < min_share:
            continue
        k = len(small)
        saving = (1 - 1 / k) * max(view.ns_share(api_ns), 0.5 * (view.gpu_share(gpu_ns) if has_gpu else 0.0))
        ev = {
            "distinct_small_kernels": k,
            "launches": launches,
            "launch_share": round(launch_share, 4),
            "api_cpu_ns": api_ns,
            **view.unavailable_evidence("gpu_time_ns", "kernel_count"),
        }
        if g["unnamed"]:
            ev["launches_without_kernel_name"] = g["unnamed"]
        if has_gpu:
            ev["gpu_time_ns"] = gpu_ns
            ev["mean_kernel_ns"] = round(gpu_ns / max(1, launches))
        add_time_base(view, ev)
        top = sorted(small, key=lambda n: -(small[n][1] or small[n][0]))[:6]
        out.append(
            Finding(
                rule=FUSION,
                severity=severity_for(saving, 0.1, 0.02),
                path=line_path(view, ln, g["node"]),
                title=f"{k} small kernels launched from one line ({launches} launches): "
                + ", ".join(kernel_label(n) for n in top),
                evidence=ev,
                fix="Fuse them: wrap this code in torch.compile (mode='reduce-overhead' also captures "
                "CUDA graphs), use a fused op (F.scaled_dot_product_attention, fused LayerNorm/GELU, "
                "optimizer foreach=True/fused=True), or capture the step with torch.cuda.graphs. "
                "Kernels: " + "; ".join(kernel_label(n, 120) for n in top),
                estimated_saving=round(min(saving, 0.9), 4),
            )
        )
    return out


@rule(LAUNCH)
def launch_bound(snapshot: Snapshot, *, config: RuleConfig) -> list[Finding]:
    view = view_of(snapshot)
    ratio = config.param(LAUNCH, "api_to_gpu_ratio", 1.0)
    min_share = config.param(LAUNCH, "min_share", 0.02)
    min_launches = int(config.param(LAUNCH, "min_launches", 20))
    has_gpu = view.col("gpu_time_ns") is not None
    idle = idle_finding(view, config, LAUNCH)
    out = [idle] if idle is not None else []
    st = step_of(view)
    busy = st.busy_share if st is not None else None
    top_cpu = _top_cpu_line(view)
    for ln, g in _per_line_kernels(view).items():
        api_ns = g["api_cpu_ns"]
        launches = sum(k[0] or k[2] for k in g["kernels"].values()) + g["unnamed"]
        gpu_ns = sum(k[1] for k in g["kernels"].values())
        if launches < min_launches or view.ns_share(api_ns) < min_share:
            continue
        ev = {"api_cpu_ns": api_ns, "launches": launches, "api_ns_per_launch": round(api_ns / launches),
              **view.unavailable_evidence("gpu_time_ns")}
        add_time_base(view, ev)
        if has_gpu:
            if api_ns < ratio * gpu_ns:
                continue
            ev["gpu_time_ns"] = gpu_ns
            ev["api_to_gpu_ratio"] = round(api_ns / max(1, gpu_ns), 3)
            if busy is not None:
                ev["process_gpu_busy_share"] = round(busy, 4)
            # The GPU waits for the CPU: what the CPU spends at this line beyond the GPU time of
            # its kernels (launch calls and the Python around them) is what batching or CUDA
            # graphs can take away; at least the launch time in excess of the GPU time.
            own_cpu = view.cpu_share(_line_cpu(view).get(ln, 0))
            saving = max(view.ns_share(api_ns - gpu_ns), own_cpu - view.gpu_share(gpu_ns))
            ev["line_cpu_share"] = round(own_cpu, 4)
            title = f"launch-bound: {ev['api_to_gpu_ratio']}x more CPU time launching than GPU time in the kernels"
            severity = severity_for(saving, 0.15, 0.05)
        else:
            saving = 0.0
            title = "possibly launch-bound: many launches with high API CPU time (GPU time not measured)"
            severity = "low"
        where = f" While the GPU starved, the CPU was busiest at {top_cpu}." if top_cpu else ""
        out.append(
            Finding(
                rule=LAUNCH,
                severity=severity,
                path=line_path(view, ln, g["node"]),
                title=title,
                evidence=ev,
                fix="The GPU finishes each kernel before the CPU can launch the next: launch fewer, "
                "larger kernels (bigger batches, torch.compile), capture the step in CUDA graphs "
                "(torch.compile(mode='reduce-overhead') or torch.cuda.graphs), and move Python work "
                "out of the step." + where,
                estimated_saving=round(min(max(saving, 0.0), 0.9), 4),
            )
        )
    return out


def _line_cpu(view: View) -> dict[int, int]:
    def compute() -> dict[int, int]:
        col = view.col(view.cpu_metric) if view.cpu_metric else None
        per: dict[int, int] = {}
        if col:
            line = view.line
            for i, v in enumerate(col):
                if v:
                    per[line[i]] = per.get(line[i], 0) + v
        return per

    return view.memo("line_cpu", compute)  # type: ignore[return-value]


def _top_cpu_line(view: View) -> str | None:
    per = _line_cpu(view)
    if not per:
        return None
    ln = max(per, key=per.get)
    return view.frames[ln].label() if ln else None
