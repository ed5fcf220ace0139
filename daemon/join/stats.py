"""What the join counts (`JoinStats`: the session's stats, Health, /metrics) and the notes it leaves
in a profile's meta.

Pure (no privilege, no I/O); written on the process's aggregation thread only.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from stacklens.records.agent import AgentStats

AGENT_DROP_KINDS = ("samples", "gpu", "gpu_buffers", "messages", "jax", "inductor")
AGENT_STAT_MAX = 1 << 53


def _agent_gauge(v) -> int:
    """A number the target reported, as a stats value: never negative, never huge (the values
    are summed into uint64 fields across processes: Health, /metrics)."""
    try:
        return min(max(0, round(v)), AGENT_STAT_MAX)
    except (TypeError, ValueError, OverflowError):
        return 0


@dataclass
class JoinStats:
    events: int = 0
    cpu_samples: int = 0
    launches: int = 0
    agent_records: int = 0
    kernels_joined: int = 0
    kernels_unmatched: int = 0
    launches_unmatched: int = 0
    rejected: int = 0
    extra: dict[str, int] = field(default_factory=dict)

    def as_dict(self) -> dict[str, int]:
        d = {k: v for k, v in self.__dict__.items() if isinstance(v, int)}
        d.update(self.extra)
        return d

    def agent_report(self, rec: AgentStats) -> None:
        """The agent's own view, latest report: its samples and what it dropped."""
        ex = self.extra
        ex["agent_samples"] = _agent_gauge(rec.samples)
        ex["agent_sample_hz"] = _agent_gauge(rec.sample_hz)
        ex["agent_sample_cost_us"] = _agent_gauge(rec.sample_cost_us)
        for k in AGENT_DROP_KINDS:        # known names only: the keys come from the target
            v = rec.dropped.get(k)
            if isinstance(v, int) and not isinstance(v, bool):
                ex[f"agent_dropped_{k}"] = _agent_gauge(v)


def add_note(meta: dict, note: str) -> None:
    """`note` in the profile's notes (meta["notes"]), once."""
    notes = meta.setdefault("notes", [])
    if note not in notes:
        notes.append(note)
