"""Findings across the ranks of one torch.distributed job: the straggler rule.

A collective ends when its last rank arrives, so the ranks that arrive early wait in it: the
probes measure that wait as `collective_wait_ns` (c10d `Work::wait`, DDP's
`Reducer::finalize_backward`) under the line that waited. Over the same window, the straggler is
the rank that waits least while the others wait much more; where it loses the time is the line of
its own code whose CPU time exceeds the other ranks' median for that line by the most.

    from stacklens.analyzer.job import stragglers
    for f in stragglers({0: snap0, 1: snap1}):    # rank -> that rank's snapshot of one window
        print(f.title)

Pure (the analyzer's contract): snapshots in, findings out. A rank whose snapshot did not
measure collective waits (no probes on its libtorch) leaves the job without a finding, said in
`job_notes`, never read as a zero wait.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from statistics import median

from stacklens.analyzer.finding import Finding
from stacklens.analyzer.step import user_lines
from stacklens.analyzer.view import View, view_of
from stacklens.cct import Snapshot

WAIT = "collective_wait_ns"
MIN_WAIT_GAP = 0.05     # the others wait at least 5% of the window more than the straggler
HIGH_WAIT_GAP = 0.20


@dataclass(frozen=True)
class RankTime:
    """One rank over the window: its wait in collectives and the CPU time of each of its lines."""

    rank: int
    wall_ns: float
    wait_ns: int
    line_cpu_ns: dict[tuple[str, str, int], float]   # (file, function, line) -> CPU ns
    line_node: dict[tuple[str, str, int], int]       # a node of that line (for the finding's path)
    view: View

    @property
    def wait_share(self) -> float:
        return self.wait_ns / self.wall_ns if self.wall_ns else 0.0


def rank_time(rank: int, snap: Snapshot) -> RankTime | None:
    """None when the snapshot cannot say: no collective waits measured, or no time base."""
    view = view_of(snap)
    if WAIT not in view.snap.metrics or WAIT in view.unavailable or not view.wall_ns:
        return None
    own = user_lines(view)
    hz = view.cpu_hz
    col = view.col("cpu_samples")
    cpu: dict[tuple[str, str, int], float] = {}
    nodes: dict[tuple[str, str, int], int] = {}
    if col is not None and hz:
        for i, v in enumerate(col):
            if not v or not own[i]:
                continue
            f = view.frames[own[i]]
            key = (f.file, f.name, f.line)
            cpu[key] = cpu.get(key, 0.0) + v / hz * 1e9
            nodes.setdefault(key, own[i])
    return RankTime(rank, view.wall_ns, view.totals.get(WAIT, 0), cpu, nodes, view)


def job_notes(snaps: Mapping[int, Snapshot]) -> list[str]:
    """Why a job has no straggler finding where it cannot have one."""
    missing = sorted(r for r, s in snaps.items() if rank_time(r, s) is None)
    notes = []
    if len(snaps) < 2:
        notes.append("stragglers: fewer than 2 ranks attached")
    if missing:
        notes.append(f"stragglers: ranks {', '.join(map(str, missing))} measured no collective waits "
                     "(no probes on their libtorch_cpu, or no time base)")
    return notes


def stragglers(snaps: Mapping[int, Snapshot], *, min_gap: float = MIN_WAIT_GAP) -> list[Finding]:
    """The straggler finding of a job (rank -> snapshot of the same window), or []."""
    times = [t for r, s in sorted(snaps.items()) if (t := rank_time(r, s)) is not None]
    if len(times) < 2 or len(times) < len(snaps):
        return []
    slow = min(times, key=lambda t: t.wait_share)
    others = [t for t in times if t is not slow]
    gap = median(t.wait_share for t in others) - slow.wait_share
    if gap < min_gap:
        return []
    # the line where the straggler spends more CPU than the others do on the same line
    excess = {k: ns - median(o.line_cpu_ns.get(k, 0.0) for o in others) for k, ns in slow.line_cpu_ns.items()}
    key = max(excess, key=excess.get, default=None)
    if key is None or excess[key] <= 0:
        return []
    extra = excess[key] / slow.wall_ns
    file, func, line = key
    waits = ", ".join(f"rank {t.rank} {100 * t.wait_share:.0f}%" for t in times)
    evidence = {f"rank{t.rank}_collective_wait_share": round(t.wait_share, 4) for t in times}
    evidence.update({"straggler_rank": float(slow.rank), "line_extra_cpu_share": round(extra, 4),
                     "others_wait_share_median": round(gap + slow.wait_share, 4)})
    return [Finding(
        rule="straggler",
        severity="high" if gap >= HIGH_WAIT_GAP else "medium",
        path=slow.view.labels(slow.line_node[key]),
        title=(f"rank {slow.rank} is the straggler: {file}:{line} ({func}) takes {100 * extra:.0f}% of its "
               f"time more than on the other ranks; the others wait for it in collectives "
               f"(time waiting: {waits})"),
        evidence=evidence,
        fix=(f"even out the work of rank {slow.rank} at this line (its data shard, an extra computation, "
             "a host-side step only it runs), or overlap it with the collectives"),
        estimated_saving=round(min(1.0, max(0.0, min(gap, extra))), 4),
    )]


__all__ = ["RankTime", "rank_time", "stragglers", "job_notes"]
