"""launch_bound from the GPU's idle time: the GPU idle most of the window while the process
launches many small kernels. Part of the `launch_bound` rule (rules/gpu_launch.py calls it).

Pure, no privilege; O(nodes) over the shared view. The model (analyzer/step.py): the idle time is
charged to the user's Python lines by their share of CPU samples (what the CPU was doing while
the GPU waited); CUDA graphs close the idle time of lines that launch kernels and do not
synchronize (a sync cannot be captured), and leave the kernels' own GPU time plus a gap per
replayed kernel (`graph_gap_ns`, GRAPH_GAP_NS: 0.25 µs measured on the H200 between dependent small
kernels of a replayed graph, 8.1 µs eager; benchmarks/gpu/graph_gap.py, docs/benchmarks/gpu-run32-graphgap).
What the CPU does per step outside the captured region (the decoding loop's own Python) is not
modelled: the estimate is an upper bound, and the finding says so.
"""

from __future__ import annotations

from stacklens.analyzer.config import RuleConfig
from stacklens.analyzer.finding import Finding, severity_for
from stacklens.analyzer.step import Step, step_of, user_lines
from stacklens.analyzer.view import View
from stacklens.analyzer.rules._common import is_sync_api, where

GRAPH_GAP_NS = 250.0   # H200, torch 2.11: replayed graph, 500 dependent tanh kernels, widths 768-49152


def _per_user_line(view: View) -> dict[int, list[float]]:
    """user line -> [cpu samples, launches, sync wait ns, sync calls seen]."""
    own = user_lines(view)
    cm = view.cpu_metric
    cpu = view.col(cm) if cm else None
    launches = view.col("launch_count") or view.col("kernel_count")
    wait = view.col("sync_wait_ns")
    frames = view.frames
    out: dict[int, list[float]] = {}
    for i in range(1, view.n):
        c = cpu[i] if cpu else 0
        n = launches[i] if launches else 0
        w = wait[i] if wait else 0
        f = frames[i]
        s = f.kind == "gpu_api" and is_sync_api(f.name)
        if not (c or n or w or s):
            continue
        acc = out.setdefault(own[i], [0, 0, 0, 0])
        acc[0] += c
        acc[1] += n
        acc[2] += w
        acc[3] += s
    return out


def _applies(view: View, st: Step, config: RuleConfig, rule: str) -> bool:
    max_busy = config.param(rule, "max_gpu_busy_share", 0.5)
    min_launches = int(config.param(rule, "min_launches_total", 1000))
    small_ns = config.param(rule, "small_kernel_ns", 50_000.0)
    min_cpu = config.param(rule, "min_cpu_busy_share", 0.5)
    if st.busy_share > max_busy or st.launches < min_launches:
        return False
    if st.kernels and st.mean_kernel_ns > small_ns:
        return False
    # The GPU waits for the CPU only if the CPU is busy: an idle CPU waits on something else.
    return st.thread_cpu_ns is None or st.thread_cpu_ns >= min_cpu * st.wall_ns


def idle_finding(view: View, config: RuleConfig, rule: str) -> Finding | None:
    st = step_of(view)
    if st is None or not _applies(view, st, config, rule):
        return None
    lines = _per_user_line(view)
    by_cpu = sum(a[0] for a in lines.values()) > 0
    total = sum(a[0] if by_cpu else a[1] for a in lines.values()) or 1
    charged = {ln: st.idle_ns * (a[0] if by_cpu else a[1]) / total for ln, a in lines.items()}
    graphable = [ln for ln, a in lines.items() if ln and a[1] and not (a[2] or a[3])]
    gap_ns = config.param(rule, "graph_gap_ns", GRAPH_GAP_NS)
    closed = max(0.0, sum(charged[ln] for ln in graphable) - gap_ns * sum(lines[ln][1] for ln in graphable))
    saving = st.idle_saving(closed)
    ranked = sorted((ln for ln in charged if ln), key=lambda ln: -charged[ln])
    if not ranked:
        return None
    top = max(graphable, key=charged.get) if graphable else ranked[0]
    ev = {**st.evidence(), "launches": st.launches, "launches_per_s": round(st.launches / st.wall_ns * 1e9),
          "mean_kernel_ns": round(st.mean_kernel_ns), "closable_idle_ns": round(closed),
          "top_line_idle_share": round(charged[top] / st.idle_ns, 4) if st.idle_ns else 0.0}
    if not gap_ns:
        ev["graph_gap_ns_unavailable"] = 1.0
    spent = "; ".join(
        f"{where(view.frames[ln])}: {100 * charged[ln] / st.idle_ns:.0f}% of the idle time, "
        f"{int(lines[ln][1])} launches" + (" (synchronizes: not capturable)" if ln not in graphable else "")
        for ln in ranked[:4]
    ) if st.idle_ns else ""
    return Finding(
        rule=rule,
        severity=severity_for(saving, 0.15, 0.05),
        path=view.labels(top),
        title=f"launch-bound: the GPU was idle {100 * (1 - st.busy_share):.0f}% of the window while the CPU "
        f"launched {ev['launches_per_s']} kernels/s (mean {st.mean_kernel_ns / 1000:.1f} µs of GPU time each); "
        f"the idle time was spent at {where(view.frames[top])}",
        evidence=ev,
        fix="Capture the step in CUDA graphs so its kernels replay without a CPU launch each: "
        "`torch.compile(model, mode='reduce-overhead')`, or torch.cuda.graphs by hand (static shapes; "
        "for decoding a static KV cache); fewer, larger kernels (batching, torch.compile) help too. "
        f"Where the idle time went: {spent}. Estimate: the GPU idle time charged to lines that launch "
        "kernels and do not synchronize (by their share of CPU samples) is closed, their kernels' GPU "
        f"time stays, plus {gap_ns:.0f} ns per replayed kernel (the gap measured between kernels of a "
        "replayed graph); the loop's own Python outside the graph is not modelled, so it is an upper "
        f"bound. Window: {st.wall_ns / 1e9:.2f} s ({view.wall_source}).",
        estimated_saving=round(min(saving, 0.95), 4),
    )
