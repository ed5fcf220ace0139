"""Prometheus exposition: a pull collector over session snapshots (never touched by the hot path).

Names: `stacklens_` prefix, `_total` counters, base units (`_seconds`, `_bytes`); one family per
metric of the registry (cct/metrics.py: name, HELP, unit), so a new metric is exported without an
edit here; a sample count with a known rate (CPU samples) also as `_seconds_total`. Process labels
`pid`, `comm`, `container`, and `rank`, `local_rank`, `world_size` from a torch.distributed rank's
environment (empty for other processes; bounded by the attached processes); a process's series
end when it is detached. Node-wide counters
(`stacklens_events_total`, `_drops_total`, `_unjoined_total`, …) never decrease: they count every
session since the daemon started (the daemon keeps the final stats of detached ones, `health()`),
and a scrape never exports less than the one before. Hotspots are the top-K contexts per process
under a short bounded `context` label (innermost Python frame, operator, a non-native leaf) and the
context's innermost Python line as `line` (`site-packages/torch/nn/modules/linear.py:125`, a
script's file relative to its directory), plus `[other]` for the rest; never a raw kernel name or a
whole stack. The set is kept across scrapes (`HotspotTracker`): a newcomer must clearly beat the
weakest exported context, the one that leaves for it is the one that grew least lately, and one
that left comes back only when it grows several times faster than the boundary, so series do not
churn at the boundary; every hotspot series is a counter that never decreases. A cap on
hotspot series over all processes: a process that meets it gets its rest as `[other]` too, and one
left with no room is counted in `stacklens_series_evicted_total`. The daemon's own process metrics
(`process_cpu_seconds_total`, `process_resident_memory_bytes`, open fds, start time) come from
prometheus_client's ProcessCollector (`build_registry`); `stacklens_build_info` names the daemon's
version, its Python's and bcc's. No privilege beyond the daemon's.

The daemon's TCP endpoint (daemon/metrics_http.py `MetricsServer`) is readable by every local
user, so hotspot series (file:function:line of other users' processes) are exported only when asked
for (`hotspots=True`; stacklensd `--metrics-hotspots` / `metrics_hotspots = true`); totals per
process are always there.
"""

from __future__ import annotations

import collections
import importlib.util
import platform
import re
import logging
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Mapping

from prometheus_client import CollectorRegistry, ProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily
from prometheus_client.registry import Collector

from stacklens.cct import Frame, Snapshot, metrics
from stacklens.cct.labels import context_label
# re-exported (`__all__`): tests still read the endpoint's names as prom.WORKERS, ...
from stacklens.daemon.metrics_http import ACCEPT_PAUSE_S, MAX_CONNECTIONS, WORKERS, MetricsServer
from stacklens.introspect.ranks import NO_RANK_LABELS, RankProc
from stacklens.introspect.procfs import ProcFS

log = logging.getLogger(__name__)

# metric → (exported name stem, scale to base unit, help), from the registry (cct/metrics.py)
PROCESS_METRICS = {m.name: (m.prom, metrics.base_unit_scale(m.name), m.help) for m in metrics.REGISTRY}
# sample counts also exported in seconds: metric → (stem, help)
SECONDS_METRICS = {m.name: (m.seconds_prom, m.seconds_help) for m in metrics.REGISTRY if m.seconds_prom}
HOTSPOT_METRICS = metrics.HOTSPOT
LINE_LABEL_MAX = 80
OTHER = "[other]"
NO_LINE = "[none]"          # the `line` of a context with no Python frame (native, kernels only)


def build_labels() -> dict[str, str]:
    """stacklens_build_info's labels: what the daemon knows without importing anything heavy (bcc's
    version is read from its version.py, never by importing bcc, which loads libbcc)."""
    from stacklens import __version__

    bcc = "unknown"
    try:
        spec = importlib.util.find_spec("bcc")
        if spec is not None and spec.origin:
            text = (Path(spec.origin).parent / "version.py").read_text()
            found = re.search(r"__version__\s*=\s*['\"]([^'\"]{1,40})['\"]", text)
            bcc = found.group(1) if found else bcc
    except (ImportError, OSError, ValueError):
        pass
    return {"version": __version__, "python": platform.python_version(), "bcc": bcc}


def _drops(st: Mapping[str, int]) -> int:
    return sum(v for k, v in st.items() if "drop" in k or "lost" in k)


# Node-wide counters, stacklens_<name>_total: name → (help, value from the stats summed over every
# session the daemon has had, plus the daemon's own counters: `StacklensCollector.health`).
NODE_COUNTERS: dict[str, tuple[str, Callable[[Mapping[str, int]], int]]] = {
    "events": ("events joined, every session since the daemon started", lambda st: st.get("events", 0)),
    "drops": ("events dropped or lost (BPF ring, agent channel, join), every session since the daemon started",
              _drops),
    "unwind_errors": ("stack unwinds that failed, every session since the daemon started",
                      lambda st: sum(v for k, v in st.items() if "unwind" in k)),
    "unjoined": ("GPU launches never joined to a kernel record and kernel records never joined to a launch, "
                 "every session since the daemon started",
                 lambda st: st.get("launches_unmatched", 0) + st.get("kernels_unmatched", 0)),
    "agent_records": ("records received from in-process agents (Python samples, GPU activity), every session "
                      "since the daemon started", lambda st: st.get("agent_records", 0)),
    "attaches": ("processes attached since the daemon started", lambda st: st.get("attaches", 0)),
    "attach_failures": ("attaches that failed since the daemon started", lambda st: st.get("attach_failures", 0)),
    "detaches": ("processes detached on request since the daemon started", lambda st: st.get("detaches", 0)),
}


@dataclass(frozen=True)
class Source:
    """One attached process as the collector reads it (a plain 5-tuple is taken as the first five)."""

    pid: int
    comm: str
    container: str
    snapshot: Snapshot
    stats: Mapping[str, int]
    cpu_hz: float | None = None         # the CPU sampling rate: samples → seconds (None: unknown)
    agent_connected: bool | None = None  # None: no agent asked for; else whether its channel is up
    rank: RankProc | None = None         # a torch.distributed rank (its environment): rank labels
    # the probes' estimated cost, a share of the process's CPU time (daemon/overhead.py); None:
    # not estimated (no real probes, or not yet: the estimate needs a first reading)
    probe_overhead: float | None = None


def short_path(file: str, roots: Iterable[str] = ()) -> str:
    """`file` as a person finds it: from its last `site-packages/` (`site-packages/torch/nn/…`,
    also for a virtualenv inside the project), else relative to the first of `roots` (the target's
    cwd or script directory) it lies under, else its last two components; a pseudo-file
    (`<string>`) as is."""
    for anchor in ("/site-packages/", "/dist-packages/"):
        i = file.rfind(anchor)
        if i >= 0:
            return file[i + 1:]
    for root in roots:
        root = root.rstrip("/")
        if root and file.startswith(root + "/"):
            return file[len(root) + 1:]
    return "/".join(file.rsplit("/", 2)[-2:]).lstrip("/")


def line_label(path: tuple[Frame, ...], roots: Iterable[str] = ()) -> str:
    """`dir/file.py:LINE` of the innermost Python frame (`short_path`; bounded, the path's head cut
    first), or NO_LINE."""
    py = next((f for f in reversed(path) if f.kind == "python"), None)
    if py is None:
        return NO_LINE
    name = short_path(py.file, roots)
    tail = f":{py.line}"
    if len(name) + len(tail) > LINE_LABEL_MAX:
        name = "…" + name[len(name) + len(tail) - LINE_LABEL_MAX + 1:]
    return name + tail


# Frames a hotspot context is not named by: a native leaf under a Python line or an operator is one
# of many symbols (BLAS kernels, allocator, libc), and an operator inside another one
# (aten::empty_memory_format inside aten::mse_loss) one of many helpers: both split one line's CPU
# into dozens of small contexts, most of them in [other] (docs/benchmarks/prometheus-hotspots.md).
_UNNAMED_LEAF = ("native", "other")


def hotspot_context(path: tuple[Frame, ...]) -> str:
    """The `context` label: context_label's parts (innermost Python frame, operator, leaf), where
    the operator is the one the Python line called (the outermost below it) and a native or
    synthetic leaf is not named when a Python frame or an operator names the context."""
    up = [f for f in reversed(path) if f.kind not in _UNNAMED_LEAF]
    if not any(f.kind in ("python", "op") for f in up):
        return context_label(reversed(path))
    py = next((i for i, f in enumerate(up) if f.kind == "python"), len(up))
    inner_ops = [i for i in range(py) if up[i].kind == "op"][:-1]
    return context_label(f for i, f in enumerate(up) if i not in inner_ops)


def roots_of(snap: Snapshot) -> tuple[str, ...]:
    """Directories that `line` labels are relative to: the target's script directory and cwd,
    where the snapshot's meta carries them."""
    out = []
    script = snap.meta.get("script")
    if isinstance(script, str) and "/" in script:
        out.append(script.rsplit("/", 1)[0])
    cwd = snap.meta.get("cwd")
    if isinstance(cwd, str) and cwd.startswith("/"):
        out.append(cwd)
    return tuple(r for r in out if r.strip("/"))   # never `/`: every path would be "relative" to it


def context_values(snap: Snapshot, metric: str) -> dict[tuple[str, str], int]:
    """Exclusive `metric` per (context, line) label pair."""
    roots = roots_of(snap)
    by_label: collections.Counter[tuple[str, str]] = collections.Counter()
    for path, values in snap.iter_paths():
        v = values.get(metric, 0)
        if v:
            by_label[(hotspot_context(path), line_label(path, roots))] += v
    return by_label


def hotspots(snap: Snapshot, metric: str, k: int) -> list[tuple[str, str, int]]:
    """Top-k (context, line, value) by exclusive `metric` (summed per label pair) plus
    ([other], [other], rest): one look, without the collector's memory (`HotspotTracker`)."""
    by_label = context_values(snap, metric)
    top = collections.Counter(by_label).most_common(max(0, k))
    rest = sum(by_label.values()) - sum(v for _, v in top)
    out = [(c, line, v) for (c, line), v in top]
    if rest:
        out.append((OTHER, OTHER, rest))
    return out


MARGIN = 0.25       # a newcomer must beat the weakest exported context's score by this share
RETURN_BAR = 4.0    # a context that left n times returns only past RETURN_BAR**n times that margin
RATE_DECAY = 0.8    # recent growth, which picks the context that leaves, decays by this per scrape


class HotspotTracker:
    """Which contexts of one process and metric are series, kept across scrapes (hysteresis).

    Entering: ranked by a score, the context's total so far (its growth summed, a fold that shrinks
    a total ignored). Not its recent growth: at 99 Hz a few seconds give each of a hundred small
    contexts a handful of samples, so the ranks near 2k reshuffle every scrape (measured: 31 of 95
    series ended more than once in 10 minutes). A newcomer from the top 2k enters while fewer than
    k are exported, or when its score beats the weakest exported one's by MARGIN; at 2k exported it
    displaces one. A newcomer still enters fast, as it need only beat the weakest exported context.

    Leaving: the displaced context is the one that grew least lately (growth decayed by RATE_DECAY
    per scrape), not the smallest total: a warm-up context that stopped keeps a total above the
    small steady ones, and displacing those instead let them overtake it and come back (2 of 84
    series in a 10-minute scrape, docs/benchmarks/prometheus-hotspots.md). A stopped context loses
    nothing by leaving: it has nothing more to count.

    Coming back: a context that left n times enters again only when its growth since it last left
    beats the weakest exported score by MARGIN times RETURN_BAR**n (5x, then 20x, ...). Not held out
    for good: a job's later phase can make a context that once left its top hotspot, and that must
    not stay in [other] for the life of the process. Growth since leaving, not the total: a stopped
    context never comes back, and one that grows at the pace of the exported ones never catches up
    (its growth since leaving stays below their totals), so the churn near the boundary that
    displaced it cannot bring it back; only a context that now grows several times faster than the
    boundary does, and at most log(its CPU) times. A series that comes back resumes at the value it
    left with, so it stays a counter.

    Values are counters: an exported context's series counts its growth while exported (all of it
    when it is exported at first sight), [other] the growth of every other, so no series ever
    decreases, and the series (an ended one at its last value) add up to the process's total. At
    most min(2k, cap) series plus [other]."""

    def __init__(self) -> None:
        self.prev: dict[tuple[str, str], int] = {}      # each context's value at the last scrape
        self.score: dict[tuple[str, str], float] = {}
        self.rate: dict[tuple[str, str], float] = {}    # recent growth (decayed)
        self.exported: dict[tuple[str, str], float] = {}
        self.left: dict[tuple[str, str], tuple[int, float, float]] = {}   # times, score and value when it left
        self.other = 0.0

    def _admits(self, c: tuple[str, str], weakest: tuple[str, str]) -> bool:
        times, score_then, _ = self.left.get(c, (0, 0.0, 0.0))
        bar = self.score[weakest] * (1 + MARGIN) * RETURN_BAR ** times
        return self.score[c] - score_then > bar

    def _choose(self, k: int, most: int) -> list[tuple[str, str]]:
        """The contexts exported after this scrape (the rules: the class's docstring)."""
        kept = sorted((c for c in self.exported if c in self.score), key=lambda c: (-self.score[c], c))[:most]
        for c in sorted(self.score, key=lambda c: (-self.score[c], c))[: 2 * k]:
            if c in self.exported or most == 0:
                continue
            fresh = c not in self.left
            if fresh and len(kept) < min(k, most):
                kept.append(c)
                continue
            if kept and not self._admits(c, min(kept, key=lambda c: (self.score[c], c))):
                if fresh:
                    break   # ranked: no later newcomer beats the weakest either
                continue
            if len(kept) >= most:
                kept.remove(min(kept, key=lambda c: (self.rate[c], self.score[c], c)))
            kept.append(c)
        return kept

    def update(self, values: Mapping[tuple[str, str], int], k: int, cap: int | None = None
               ) -> list[tuple[str, str, float]]:
        """The series after a scrape whose values per (context, line) are `values`: at most
        min(2k, cap) contexts (k ≥ 0) plus [other]."""
        most = 2 * k if cap is None else max(0, min(2 * k, cap))
        growth = {c: max(0, v - self.prev.get(c, 0)) for c, v in values.items()}
        self.score = {c: self.score.get(c, 0) + g for c, g in growth.items()}
        self.rate = {c: self.rate.get(c, 0) * RATE_DECAY + g for c, g in growth.items()}
        kept = self._choose(k, most)
        for c, v in self.exported.items():
            if c not in kept:
                self.left[c] = (self.left.get(c, (0, 0.0, 0.0))[0] + 1, self.score.get(c, 0.0), v)
        self.exported = {c: self.exported.get(c, self.left.get(c, (0, 0.0, 0.0))[2]) + growth[c] for c in kept}
        self.left = {c: t for c, t in self.left.items() if c in values}
        self.other += sum(g for c, g in growth.items() if c not in self.exported)
        self.prev = dict(values)
        out = [(c, line, v) for (c, line), v in sorted(self.exported.items(), key=lambda kv: -self.score[kv[0]])]
        if self.other:
            out.append((OTHER, OTHER, self.other))
        return out


class StacklensCollector(Collector):
    """Reads `sources()` → [Source or (pid, comm, container, snapshot, stats)] at scrape time, and
    `health()` → stats summed over every session since start plus the daemon's counters."""

    def __init__(
        self,
        sources: Callable[[], Iterable[Source | tuple[int, str, str, Snapshot, dict[str, int]]]],
        *,
        health: Callable[[], Mapping[str, int]] = dict,
        top_k: int = 30,     # a flat CPU profile (tests/data/cpu_gpt2_train) has 11% past its top 30
        series_cap: int = 5_000,
        findings: Callable[[int, Snapshot], dict[str, int]] | None = None,
        hotspots: bool = False,
    ) -> None:
        self.sources = sources
        self.hotspots_on = hotspots
        self.health = health
        self.top_k = top_k
        self.series_cap = series_cap
        self.findings = findings
        self.series_evicted = 0
        self._hot_lock = threading.Lock()      # the trackers: scrapes run on several workers
        self._trackers: dict[tuple[str, ...], HotspotTracker] = {}
        self._build = build_labels()
        self._node_lock = threading.Lock()     # scrapes run on several workers
        self._node_exported: dict[str, float] = {}

    def describe(self):  # no describe-time scrape (prometheus_client calls collect otherwise)
        return []

    def _node_values(self) -> dict[str, float]:
        """NODE_COUNTERS now, never below what an earlier scrape exported (a session between its
        last live stats and its retired ones must not read as a counter reset)."""
        h = self.health()
        with self._node_lock:
            for name, (_, value) in NODE_COUNTERS.items():
                self._node_exported[name] = max(self._node_exported.get(name, 0), value(h))
            return dict(self._node_exported)

    def _add_hotspots(self, hot: dict, src: Source, lv: list[str], measured: list[str], budget: int,
                      trackers: dict) -> int:
        """One process's hotspot series into `hot` (by metric), within `budget` series, its
        trackers (found in the last scrape's, or new) into `trackers`; returns the budget left (a
        process past it loses its families, counted in series_evicted)."""
        snap = src.snapshot
        for m in HOTSPOT_METRICS:
            if m not in measured:
                continue
            if m in SECONDS_METRICS:
                if not src.cpu_hz:
                    continue
                scale = 1 / src.cpu_hz
            else:
                scale = PROCESS_METRICS[m][1]
            if budget <= 0:
                self.series_evicted += 1
                continue
            # room for fewer than 2·top-k + [other]: what fits, the rest in [other]
            tracker = trackers.setdefault((*lv, m), self._trackers.get((*lv, m)) or HotspotTracker())
            series = tracker.update(context_values(snap, m), min(self.top_k, budget - 1), cap=budget - 1)
            budget -= len(series)
            for context, line, v in series:
                hot[m].add_metric(lv + [context, line], v * scale)
        return budget

    def _hotspot_families(self, labels: list[str]) -> dict[str, CounterMetricFamily]:
        return {
            m: CounterMetricFamily(
                f"stacklens_hotspot_{SECONDS_METRICS[m][0] if m in SECONDS_METRICS else PROCESS_METRICS[m][0]}",
                f"{SECONDS_METRICS[m][1] if m in SECONDS_METRICS else PROCESS_METRICS[m][2]}, exclusive, for the "
                f"top-{self.top_k} contexts of each process, kept across scrapes (at most {2 * self.top_k}; "
                f"line: the context's innermost Python line); {OTHER} holds the rest",
                labels=labels + ["context", "line"],
            )
            for m in HOTSPOT_METRICS
        }

    def collect(self):
        labels = ["pid", "comm", "container", *NO_RANK_LABELS]
        fams = {
            m: CounterMetricFamily(f"stacklens_{stem}", help_, labels=labels)
            for m, (stem, _, help_) in PROCESS_METRICS.items()
        }
        seconds = {
            m: CounterMetricFamily(f"stacklens_{stem}", help_, labels=labels) for m, (stem, help_) in SECONDS_METRICS.items()
        }
        hot = self._hotspot_families(labels)
        drops = CounterMetricFamily("stacklens_process_dropped_events", "events dropped for this process", labels=labels)
        unavailable = GaugeMetricFamily(
            "stacklens_metric_unavailable", "1 when a metric is not measured for this process", labels=labels + ["metric"]
        )
        agent = GaugeMetricFamily("stacklens_agent_connected",
                                  "1 while the in-process agent's channel is up, 0 once it is gone (processes "
                                  "attached with the agent)", labels=labels)
        finding_fam = GaugeMetricFamily("stacklens_findings", "analyzer findings by rule", labels=labels + ["rule"])
        cost = GaugeMetricFamily("stacklens_probe_overhead_ratio",
                                 "the probes' estimated cost to the process: the CPU time their hits cost it over "
                                 "its CPU time in the last 2-30 s (the agent's cost not included); absent where "
                                 "not estimated", labels=labels)
        budget = self.series_cap
        attached = 0
        trackers: dict[tuple[str, ...], HotspotTracker] = {}   # a detached process's trackers go
        for src in self.sources():
            if not isinstance(src, Source):
                src = Source(*src)
            snap = src.snapshot
            attached += 1
            ranks = src.rank.labels() if src.rank is not None else NO_RANK_LABELS
            lv = [str(src.pid), src.comm, src.container, *(ranks[k] for k in NO_RANK_LABELS)]
            measured = [m for m in PROCESS_METRICS if m in snap.metrics and m not in snap.unavailable]
            for m in measured:
                fams[m].add_metric(lv, snap.total(m) * PROCESS_METRICS[m][1])
                if m in seconds and src.cpu_hz:
                    seconds[m].add_metric(lv, snap.total(m) / src.cpu_hz)
            for m in sorted(snap.unavailable):
                unavailable.add_metric(lv + [m], 1)
            drops.add_metric(lv, _drops(src.stats))
            if src.agent_connected is not None:
                agent.add_metric(lv, 1 if src.agent_connected else 0)
            if src.probe_overhead is not None:
                cost.add_metric(lv, src.probe_overhead)
            if self.hotspots_on:
                with self._hot_lock:
                    budget = self._add_hotspots(hot, src, lv, measured, budget, trackers)
            if self.findings is not None:
                try:
                    for rule, n in self.findings(src.pid, snap).items():
                        finding_fam.add_metric(lv + [rule], n)
                except Exception:  # noqa: BLE001 — a rule bug must not break the scrape
                    log.exception("analyzer failed during scrape")
        if self.hotspots_on:
            with self._hot_lock:
                self._trackers = trackers
        yield InfoMetricFamily("stacklens_build", "the daemon's version, its Python's, and bcc's where found",
                               value=self._build)
        yield from fams.values()
        yield from seconds.values()
        if self.hotspots_on:
            yield from hot.values()
        yield drops
        yield unavailable
        yield agent
        yield cost
        yield finding_fam
        yield GaugeMetricFamily("stacklens_attached_processes", "processes attached", value=attached)
        for name, v in self._node_values().items():
            yield CounterMetricFamily(f"stacklens_{name}", NODE_COUNTERS[name][0], value=v)
        yield CounterMetricFamily(
            "stacklens_series_evicted", "hotspot families of a process (one per metric) not exported because of the series cap",
            value=self.series_evicted,
        )


def build_registry(collector: StacklensCollector, *, procfs: ProcFS | None = None) -> CollectorRegistry:
    """The daemon's registry: `collector` and the daemon's own process metrics (prometheus_client's
    ProcessCollector over `procfs`'s root: process_cpu_seconds_total, process_resident_memory_bytes,
    process_open_fds, process_start_time_seconds, ...)."""
    registry = CollectorRegistry()
    registry.register(collector)
    ProcessCollector(proc=str((procfs or ProcFS()).root), registry=registry)
    return registry


__all__ = ["PROCESS_METRICS", "SECONDS_METRICS", "HOTSPOT_METRICS", "LINE_LABEL_MAX", "OTHER", "NO_LINE",
           "NODE_COUNTERS", "MARGIN", "RETURN_BAR", "RATE_DECAY", "Source", "HotspotTracker", "StacklensCollector",
           "build_labels", "short_path", "line_label", "hotspot_context", "roots_of", "context_values", "hotspots",
           "build_registry",
           # re-exported from daemon/metrics_http.py
           "MetricsServer", "WORKERS", "MAX_CONNECTIONS", "ACCEPT_PAUSE_S"]
