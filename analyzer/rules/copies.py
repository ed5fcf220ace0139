"""host_device_copies: host↔device memcpy calls in the loop (pageable memory, blocking copies).

Evidence: copy_bytes, API CPU time and sync wait of the memcpy calls under each Python line, and
the achieved bandwidth. Needs the GPU API probes; without them there is nothing to report.
"""

from __future__ import annotations

from stacklens.cct import Snapshot

from stacklens.analyzer.config import RuleConfig
from stacklens.analyzer.finding import Finding, severity_for
from stacklens.analyzer.registry import rule
from stacklens.analyzer.view import name_matcher, view_of
from stacklens.analyzer.rules._common import (
    add_time_base, api, cost, guessed, is_memcpy_api, line_path, names, op_named,
)

# guessed, not measured (the finding says so): the share of the copy time pinned memory / non_blocking removes
COPIES_SAVED = 0.7

RULE = "host_device_copies"

_host_device = name_matcher(r"htod|dtoh|^cudaMemcpy(Async)?$|^cuMemcpy(Async)?$|hipMemcpy(Async)?$")
_is_async = name_matcher(r"async")


@rule(RULE)
def host_device_copies(snapshot: Snapshot, *, config: RuleConfig) -> list[Finding]:
    view = view_of(snapshot)
    min_share = config.param(RULE, "min_share", 0.05)
    marks = view.mark(api(lambda n: is_memcpy_api(n) and _host_device(n)), kinds=("gpu_api",))
    # The one-scalar copy of `.item()` is a sync first: sync_stalls reports it.
    scalar = view.mark(op_named("item", "_local_scalar_dense"), kinds=("op",))
    nodes = [i for i, m in enumerate(marks) if m and not scalar[i]]
    groups = view.sum_by_line(nodes, ("api_cpu_ns", "sync_wait_ns", "copy_bytes", "launch_count", "cpu_samples"))
    apis: dict[int, list[int]] = {}
    for i in nodes:
        apis.setdefault(view.line[i], []).append(marks[i])
    out = []
    for ln, acc in groups.items():
        share, ev = cost(view, acc)
        nbytes = acc.get("copy_bytes", 0)
        if share < min_share:
            continue
        api_names = names(view, set(apis[ln]))
        blocking = [n for n in api_names if not _is_async(n)]
        ns = acc.get("api_cpu_ns", 0) + acc.get("sync_wait_ns", 0)
        if nbytes and ns:
            ev["gbytes_per_s"] = round(nbytes / ns, 3)
        ev.update(view.unavailable_evidence("copy_bytes", "api_cpu_ns", "sync_wait_ns"))
        add_time_base(view, ev)
        fix = (
            "Copy once outside the loop if the data does not change. Otherwise allocate the host side "
            "in pinned memory (`tensor.pin_memory()`, DataLoader(pin_memory=True)) and copy with "
            "`.to(device, non_blocking=True)` so the copy overlaps compute"
        )
        if blocking:
            fix += f"; {', '.join(blocking)} blocks the CPU until the copy is done"
        if any("dtoh" in n.lower() for n in api_names):
            fix += "; device→host copies also synchronize (see sync_stalls)"
        out.append(
            Finding(
                rule=RULE,
                severity=severity_for(share, 0.2, 0.05),
                path=line_path(view, ln, set(apis[ln])),
                title="host↔device copies in the loop: "
                + (f"{nbytes / 2**20:.1f} MiB " if nbytes else "")
                + f"{100 * share:.0f}% of the time in {', '.join(api_names[:3])}",
                evidence=ev,
                fix=fix + "." + guessed(COPIES_SAVED, "the copy time"),
                estimated_saving=round(min(COPIES_SAVED * share, 0.9), 4),
            )
        )
    return out
