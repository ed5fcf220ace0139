"""stacklens.analyzer: rules that turn a calling context tree into concrete advice.

Pure: imports only the standard library and `stacklens.cct` (import-linter contract "analyzer is
pure" and tests/unit/test_analyzer_core.py). No privilege; no I/O but one committed data file
read once (the fp32_gemm rule's measured GEMM speedups, rules/_speedups.py). Cost: one
O(nodes x metrics) pass shared by all rules, then O(nodes) per rule; a 100,000-node snapshot is analysed well
under a second (docs/benchmarks/analyzer.md).

    from stacklens.analyzer import analyze
    for f in analyze(snapshot):            # sorted: severity, then estimated saving
        print(f.severity, f.rule, f.title, f.path[-1], f.fix)

Rules (ids): hotspots, kernel_fusion, launch_bound, sync_stalls, host_device_copies,
layout_conversions, fp32_gemm, allocator_churn, backward_cost, kernel_names (informational:
launches whose kernel has no name). Each works on whatever the
snapshot measured: a metric listed in `snapshot.unavailable` is never read as 0, and findings
say in their evidence (`<metric>_unavailable = 1`) what they had to do without.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from stacklens.cct import Snapshot

from stacklens.analyzer import rules as _builtin_rules  # noqa: F401  (registers the built-in rules)
from stacklens.analyzer.config import RuleConfig, as_config
from stacklens.analyzer.finding import SEVERITIES, Finding
from stacklens.analyzer.registry import ENTRY_POINT_GROUP, plugin_errors, register, rules, unregister
from stacklens.analyzer.rules._common import path_location

__all__ = [
    "ENTRY_POINT_GROUP",
    "SEVERITIES",
    "Finding",
    "RuleConfig",
    "analyze",
    "plugin_errors",
    "register",
    "rules",
    "unregister",
]


def analyze(snapshot: Snapshot, config: RuleConfig | Mapping[str, Any] | None = None) -> list[Finding]:
    """Run every enabled rule over `snapshot`; findings sorted by severity, then saving.

    A rule that raises is skipped (analysis of a live process must not fail because of one
    rule); its error is reported as a low-severity `analyzer_error` finding.
    """
    cfg = as_config(config)
    out: list[Finding] = []
    for rule_id, fn in rules().items():
        if rule_id in cfg.disabled:
            continue
        try:
            found = list(fn(snapshot, config=cfg))
        except Exception as exc:
            out.append(
                Finding(
                    rule="analyzer_error",
                    severity="low",
                    path=(),
                    title=f"rule {rule_id} failed: {type(exc).__name__}: {exc}",
                    fix=f"report this; disable the rule with RuleConfig(disabled={{'{rule_id}'}}) meanwhile",
                )
            )
            continue
        out.extend(_located(f) for f in found if f.estimated_saving >= cfg.min_saving or f.estimated_saving == 0.0)
    out.sort(key=Finding.sort_key)
    return out


def _located(f: Finding) -> Finding:
    """Every finding titled with the Python line it is about (the innermost one in its path, and
    the user's own line that called it when that one is in a library), never only a kernel or a
    C++ frame; a title that already names the line is kept."""
    loc = path_location(f.path)
    if loc is None or loc.split(", called from ")[0].rsplit(" ", 1)[0] in f.title:
        return f
    return replace(f, title=f"{f.title} (at {loc})")
