"""View model of the process list: one row per process, its cells, and CPU% from two readings.

Pure, no privilege, no I/O, no Textual (unit-tested in tests/unit/test_tui_model.py, through
`tui.model`, which re-exports it). The daemon's listing carries each process's CPU time so far
(`ProcessInfo.cpu_time_ns`); CPU% is its growth between two listings over the time between them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class ProcessRow:
    pid: int
    comm: str
    attached: bool
    agent: bool
    state: str
    python: str = ""
    gpu_time_share: float = float("nan")
    launches_per_s: float = 0.0
    sync_wait_share: float = 0.0
    unavailable: tuple[str, ...] = ()
    cpu_time_ns: int | None = None  # utime + stime so far, from the daemon; None: not in the reply
    read_at: float = float("nan")   # when the listing was read (time.monotonic, s)
    rank: str = ""                  # a torch.distributed rank: "RANK/WORLD_SIZE"; "" for others
    # the probes' estimated cost, a share of the process's CPU time (daemon/overhead.py); NaN: not
    # estimated, and `overhead_note` says why where the daemon said (else not attached or no probes)
    probe_overhead: float = float("nan")
    overhead_note: str = ""


def cpu_shares(before: dict[int, tuple[int, float]], rows: Sequence[ProcessRow]) -> tuple[dict[int, float], dict[int, tuple[int, float]]]:
    """CPU% per PID from two successive readings of each process's CPU time: (shares, the readings
    to pass next time). A process seen once, or with no CPU time in the reply, has no share
    (NaN); a PID whose CPU time went down is a new process, seen once."""
    shares: dict[int, float] = {}
    now: dict[int, tuple[int, float]] = {}
    for p in rows:
        if p.cpu_time_ns is None or math.isnan(p.read_at):
            continue
        now[p.pid] = (p.cpu_time_ns, p.read_at)
        prev = before.get(p.pid)
        if prev is not None and p.read_at > prev[1] and p.cpu_time_ns >= prev[0]:
            shares[p.pid] = (p.cpu_time_ns - prev[0]) / 1e9 / (p.read_at - prev[1])
    return shares, now


def process_cells(p: ProcessRow, cpu_share: float | None = None) -> tuple[str, ...]:
    """The process list's cells; `cpu_share` from `cpu_shares` (None: the first reading)."""
    gpu = "unavailable" if math.isnan(p.gpu_time_share) else f"{100 * p.gpu_time_share:.1f}%"
    if p.cpu_time_ns is None:
        cpu = "unavailable"
    else:
        cpu = "…" if cpu_share is None else f"{100 * cpu_share:.1f}%"
    return (
        str(p.pid),
        p.comm,
        p.state or ("attached" if p.attached else "-"),
        "yes" if p.agent else "no",
        cpu,
        gpu,
        f"{p.launches_per_s:.1f}",
        f"{100 * p.sync_wait_share:.1f}%",
        _cost(p),
        p.rank or "-",
        p.python,
    )


def _cost(p: ProcessRow) -> str:
    """COST: the probes' estimated cost (`stacklens ps` COST%); "n/a" where the daemon said why it
    has none, "-" where there is nothing to estimate."""
    if not math.isnan(p.probe_overhead):
        return f"{100 * p.probe_overhead:.1f}%"
    return "n/a" if p.overhead_note else "-"
