"""kernel_names: says once that some launches carry no kernel name, instead of any finding
printing the handle (`unresolved:0x…`) where a name belongs.

A launch through the driver names its kernel by a CUfunction handle; BPF reads the handle's
name when it sees the module load, and the join learns it from the first GPU record of that
kernel. Launches made before either (a process attached after its modules were loaded: the
first seconds of every kernel) stay on a `kernel:unresolved:0x…` node with their launch count;
their GPU records, where CUPTI made any, are charged to the named kernel beside them.
Informational: no saving. Pure; O(nodes).
"""

from __future__ import annotations

from stacklens.cct import Snapshot

from stacklens.analyzer.config import RuleConfig
from stacklens.analyzer.finding import Finding
from stacklens.analyzer.registry import rule
from stacklens.analyzer.view import view_of
from stacklens.analyzer.rules._common import is_unnamed_kernel

RULE = "kernel_names"


@rule(RULE)
def kernel_names(snapshot: Snapshot, *, config: RuleConfig) -> list[Finding]:
    view = view_of(snapshot)
    col = view.col("launch_count") or view.col("kernel_count")
    if col is None:
        return []
    unnamed = sum(col[i] for i in range(1, view.n) if col[i] and is_unnamed_kernel(view.frames[i]))
    total = view.totals.get("launch_count") or view.totals.get("kernel_count") or 0
    if not unnamed or not total:
        return []
    return [Finding(
        rule=RULE,
        severity="low",
        path=(),
        title=f"{unnamed} kernel launches ({100 * unnamed / total:.1f}% of {total}) carry no kernel name: "
        "findings count them at their lines without naming them",
        evidence={"launches_without_kernel_name": unnamed, "launches": total},
        fix="Nothing to change in your code: these launches came before stacklens learnt their kernel's name "
        "(the name arrives with the kernel's first GPU record, seconds after attach); their GPU time, where "
        "recorded, is charged to the named kernel at the same line.",
    )]
