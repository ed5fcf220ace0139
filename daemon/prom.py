"""Prometheus exposition: a pull collector over session snapshots (never touched by the hot path).

Names: `stacklens_` prefix, `_total` counters, `_seconds`, `_bytes`. Process labels `pid`, `comm`,
`container`. Hotspots are the top-K contexts per process under a short bounded `context` label plus
`[other]`; never a raw kernel name or a whole stack. A cap on hotspot series, with a counter of
evictions. No privilege beyond the daemon's.
"""

from __future__ import annotations

import collections
import logging
from typing import Callable, Iterable

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from stacklens.cct import Frame, Snapshot

log = logging.getLogger(__name__)

# metric → (exported name stem, scale to base unit, help)
PROCESS_METRICS = {
    "gpu_time_ns": ("gpu_kernel_seconds", 1e-9, "GPU kernel execution time (CUPTI/RocTracer), seconds"),
    "kernel_count": ("gpu_kernels", 1, "GPU kernels that completed (CUPTI/RocTracer)"),
    "launch_count": ("kernel_launches", 1, "GPU kernel launches seen at the driver API"),
    "api_cpu_ns": ("api_cpu_seconds", 1e-9, "CPU time inside GPU driver API calls, seconds"),
    "sync_wait_ns": ("sync_wait_seconds", 1e-9, "time the host waited in GPU synchronization calls"),
    "copy_bytes": ("copied_bytes", 1, "bytes copied between host and device"),
    "alloc_bytes": ("allocated_bytes", 1, "bytes allocated on the device"),
    "cpu_samples": ("cpu_samples", 1, "CPU samples (perf cpu-clock) of the process"),
}
HOTSPOT_METRICS = ("gpu_time_ns", "cpu_samples", "sync_wait_ns")
CONTEXT_LABEL_MAX = 120


def context_label(path: tuple[Frame, ...]) -> str:
    """A short, bounded name for a context: innermost Python line, innermost op, and the leaf."""
    py = next((f for f in reversed(path) if f.kind == "python"), None)
    op = next((f for f in reversed(path) if f.kind == "op"), None)
    parts = []
    if py is not None:
        parts.append(f"{py.file.rsplit('/', 1)[-1]}:{py.name}:{py.line}")
    if op is not None:
        parts.append(op.name)
    if path and path[-1] not in (py, op):
        leaf = path[-1]
        parts.append(leaf.label() if leaf.kind != "kernel" else "kernel:" + leaf.name[:40])
    label = " > ".join(parts) or "[root]"
    return label if len(label) <= CONTEXT_LABEL_MAX else label[: CONTEXT_LABEL_MAX - 1] + "…"


def hotspots(snap: Snapshot, metric: str, k: int) -> list[tuple[str, int]]:
    """Top-k contexts by exclusive `metric` (summed per short label) plus `[other]` for the rest."""
    by_label: collections.Counter[str] = collections.Counter()
    for path, values in snap.iter_paths():
        v = values.get(metric, 0)
        if v:
            by_label[context_label(path)] += v
    top = by_label.most_common(k)
    rest = sum(by_label.values()) - sum(v for _, v in top)
    if rest:
        top.append(("[other]", rest))
    return top


class StacklensCollector(Collector):
    """Reads `sources()` → [(pid, comm, container, snapshot, stats)] at scrape time."""

    def __init__(
        self,
        sources: Callable[[], Iterable[tuple[int, str, str, Snapshot, dict[str, int]]]],
        *,
        health: Callable[[], dict[str, int]] = dict,
        top_k: int = 10,
        series_cap: int = 5_000,
        findings: Callable[[int, Snapshot], dict[str, int]] | None = None,
    ) -> None:
        self.sources = sources
        self.health = health
        self.top_k = top_k
        self.series_cap = series_cap
        self.findings = findings
        self.series_evicted = 0

    def describe(self):  # no describe-time scrape (prometheus_client calls collect otherwise)
        return []

    def collect(self):
        labels = ["pid", "comm", "container"]
        fams = {
            m: CounterMetricFamily(f"stacklens_{stem}", help_, labels=labels)
            for m, (stem, _, help_) in PROCESS_METRICS.items()
        }
        hot = {
            m: CounterMetricFamily(
                f"stacklens_hotspot_{PROCESS_METRICS[m][0]}",
                f"top-{self.top_k} contexts by exclusive {m}; [other] holds the rest",
                labels=labels + ["context"],
            )
            for m in HOTSPOT_METRICS
        }
        drops = CounterMetricFamily("stacklens_process_dropped_events", "events dropped for this process", labels=labels)
        unavailable = GaugeMetricFamily(
            "stacklens_metric_unavailable", "1 when a metric is not measured for this process", labels=labels + ["metric"]
        )
        finding_fam = GaugeMetricFamily("stacklens_findings", "analyzer findings by rule", labels=labels + ["rule"])
        budget = self.series_cap
        attached = 0
        for pid, comm, container, snap, stats in self.sources():
            attached += 1
            lv = [str(pid), comm, container]
            for m, (_, scale, _) in PROCESS_METRICS.items():
                if m in snap.metrics and m not in snap.unavailable:
                    fams[m].add_metric(lv, snap.total(m) * scale)
            for m in sorted(snap.unavailable):
                unavailable.add_metric(lv + [m], 1)
            drops.add_metric(lv, sum(v for k, v in stats.items() if "drop" in k or "lost" in k))
            for m in HOTSPOT_METRICS:
                if m not in snap.metrics or m in snap.unavailable:
                    continue
                scale = PROCESS_METRICS[m][1]
                for label, v in hotspots(snap, m, self.top_k):
                    if budget <= 0:
                        self.series_evicted += 1
                        continue
                    budget -= 1
                    hot[m].add_metric(lv + [label], v * scale)
            if self.findings is not None:
                try:
                    for rule, n in self.findings(pid, snap).items():
                        finding_fam.add_metric(lv + [rule], n)
                except Exception:  # noqa: BLE001 — a rule bug must not break the scrape
                    log.exception("analyzer failed during scrape")
        yield from fams.values()
        yield from hot.values()
        yield drops
        yield unavailable
        yield finding_fam
        yield GaugeMetricFamily("stacklens_attached_processes", "processes attached", value=attached)
        h = self.health()
        for key in ("events", "drops", "unwind_errors"):
            yield CounterMetricFamily(f"stacklens_{key}", f"daemon-wide {key.replace('_', ' ')}", value=h.get(key, 0))
        yield CounterMetricFamily(
            "stacklens_series_evicted", "hotspot series not exported because of the series cap", value=self.series_evicted
        )
