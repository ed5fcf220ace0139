"""allocator_churn: memory allocated again on every step instead of reused.

Evidence, whichever is measured: alloc_bytes charged under each Python line (the caching
allocator's / CPU allocator's requests), driver allocations after warm-up (cuMemAlloc,
cudaMalloc, cuMemFree… — the caching allocator should make these rare), and the CPU time of
allocating operators (`aten::empty`, `aten::zeros`…) and of the C allocator (malloc, mmap,
page faults) below the line.
"""

from __future__ import annotations

from stacklens.cct import Frame, Snapshot

from stacklens.analyzer.config import RuleConfig
from stacklens.analyzer.finding import Finding, severity_for
from stacklens.analyzer.registry import rule
from stacklens.analyzer.view import name_matcher, view_of
from stacklens.analyzer.rules._common import (
    add_time_base, api, cost, guessed, is_alloc_api, line_path, names, op_named,
)

# guessed, not measured (the finding says so): the share of the allocation time a fix removes
ALLOC_SAVED = 0.8

RULE = "allocator_churn"

_alloc_op = op_named("empty", "zeros", "ones", "full", "new_empty", "new_zeros", "new_full", "empty_like",
                     "zeros_like", "ones_like", "full_like")
_alloc_native = name_matcher(
    r"^(malloc|free|calloc|realloc|posix_memalign|aligned_alloc|mmap64|mmap|munmap|__munmap|__mmap|"
    r"_int_malloc|_int_free|sysmalloc|clear_page.*|asm_exc_page_fault|do_anonymous_page|"
    r"c10::alloc_cpu|c10::free_cpu|c10::cuda::CUDACachingAllocator.*malloc.*)$"
)


def _is_alloc(f: Frame) -> bool:
    if f.kind == "gpu_api":
        return is_alloc_api(f.name)
    if f.kind == "native":
        return _alloc_native(f.name.split("(")[0])
    return _alloc_op(f)


@rule(RULE)
def allocator_churn(snapshot: Snapshot, *, config: RuleConfig) -> list[Finding]:
    view = view_of(snapshot)
    min_share = config.param(RULE, "min_share", 0.02)

    marks = view.mark(_is_alloc, kinds=("op", "gpu_api", "native"))
    alloc = view.col("alloc_bytes")
    alloc_total = view.totals.get("alloc_bytes", 0)
    cost_nodes = [i for i, m in enumerate(marks) if m]
    metrics = ("cpu_samples", "py_samples", "api_cpu_ns", "sync_wait_ns")
    groups = view.sum_by_line(cost_nodes, metrics)
    bytes_by_line: dict[int, int] = {}
    if alloc:
        line = view.line
        for i in view.nodes_with_value(("alloc_bytes",)):
            if line[i] in groups:
                bytes_by_line[line[i]] = bytes_by_line.get(line[i], 0) + alloc[i]
    heads: dict[int, set[int]] = {}
    for i in cost_nodes:
        heads.setdefault(view.line[i], set()).add(marks[i])
    api_calls = {ln for ln, hs in heads.items() if any(view.frames[h].kind == "gpu_api" for h in hs)}

    out = []
    for ln in groups:  # bytes alone are no cost (see below): lines with allocation cost only
        acc = groups.get(ln, {})
        share, ev = cost(view, acc)
        nbytes = bytes_by_line.get(ln, 0)
        if nbytes:
            ev["alloc_bytes"] = nbytes
            if alloc_total:
                ev["share_of_alloc_bytes"] = round(nbytes / alloc_total, 4)
            if view.wall_ns:
                ev["alloc_bytes_per_s"] = round(nbytes / (view.wall_ns / 1e9))
        # Bytes alone are no cost: small blocks come back from malloc's or the caching
        # allocator's free lists for nothing. The rule fires on measured cost: allocating
        # operators, allocator frames, driver allocations.
        driver = ln in api_calls and view.ns_share(acc.get("api_cpu_ns", 0) + acc.get("sync_wait_ns", 0)) >= min_share / 4
        if not (driver or share >= min_share):
            continue
        ev.update(view.unavailable_evidence("alloc_bytes", "api_cpu_ns"))
        add_time_base(view, ev)
        hs = heads.get(ln, set())
        what = names(view, hs) if hs else []
        fix = (
            "Allocate once and reuse: preallocate buffers outside the loop and write into them "
            "(`torch.mul(a, b, out=buf)`, in-place `add_`/`copy_`, `torch.zeros` → `buf.zero_()`), "
            "keep shapes static so cached blocks fit"
        )
        if driver:
            fix += (
                "; cuMemAlloc/cuMemFree in steady state mean the caching allocator is releasing memory: "
                "remove torch.cuda.empty_cache() from the loop, and set "
                "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True against fragmentation"
            )
        out.append(
            Finding(
                rule=RULE,
                severity=severity_for(share, 0.15, 0.05),
                path=line_path(view, ln, hs or {ln}),
                title="allocator churn: "
                + (f"{nbytes / 2**20:.0f} MiB allocated, " if nbytes else "")
                + f"{100 * share:.0f}% of the time allocating"
                + (f" in {', '.join(what[:3])}" if what else ""),
                evidence=ev,
                fix=fix + "." + guessed(ALLOC_SAVED, "the time allocating"),
                estimated_saving=round(min(ALLOC_SAVED * share, 0.9), 4),
            )
        )
    return out
