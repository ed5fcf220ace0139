"""A row of `stacklens ps` (ListProcesses): a process on the node, what stacklensd holds of it,
and for an attached one its rates over the last 10 s and the probes' estimated cost to it."""

from __future__ import annotations

import time

from stacklens.daemon import stacklens_pb2 as pb
from stacklens.daemon.core import NOT_ATTACHED
from stacklens.daemon.ranks import RankProc
from stacklens.errors import StacklensError

RATES_S = 10.0


def process_row(daemon, info, s) -> pb.ProcessInfo:
    """`info`: what discovery saw of the process (None: not seen); `s`: its session, attach in
    progress, closed session or None (core.Daemon.processes)."""
    p = pb.ProcessInfo(
        pid=(info.pid if info else s.pid),
        comm=(info.comm if info else s.comm),
        attached=s is not None and s.state in ("attached", "starting"),
        agent=bool(s and s.agent is not None),
        state=(s.state if s else NOT_ATTACHED),
        gpu=bool(info and info.gpu),
        python=(info.python or "") if info else "",
        container=(info.container if info else ""),
    )                  # gpu_time_share stays unset unless measured (JSON: no "NaN" string)
    rank = getattr(s, "rank", None) if s is not None else None
    if rank is not None:
        _set_rank(p, rank)
    if p.attached:
        p.held_by.extend(daemon.held_by(p.pid))
    cpu_ns = _cpu_time_ns(daemon, p.pid)
    if cpu_ns is not None:     # for the client's CPU% (two listings); unset if unreadable
        p.cpu_time_ns = cpu_ns
    if p.attached:             # rates of the last 10 s: a closed session has none
        try:
            _rates(daemon, p, s)
        except StacklensError:
            pass
    return p


def _rates(daemon, p: pb.ProcessInfo, s) -> None:
    snap = s.snapshot(window_s=RATES_S)
    span = min(RATES_S, max(1e-3, time.time() - s.started))
    if "gpu_time_ns" not in snap.unavailable:
        p.gpu_time_share = snap.total("gpu_time_ns") / 1e9 / span
    p.launches_per_s = snap.total("launch_count") / span
    p.sync_wait_share = snap.total("sync_wait_ns") / 1e9 / span
    p.unavailable.extend(sorted(snap.unavailable))
    est = daemon.overheads.of(s) if hasattr(daemon, "overheads") else None
    if est is not None:
        p.overhead_note = est.why
        if est.share is not None:
            p.probe_overhead = est.share


def _set_rank(p: pb.ProcessInfo, rank: RankProc) -> None:
    p.rank = rank.rank
    if rank.local_rank is not None:
        p.local_rank = rank.local_rank
    if rank.world_size is not None:
        p.world_size = rank.world_size
    p.job = rank.job


def _cpu_time_ns(daemon, pid: int) -> int | None:
    procfs = getattr(daemon, "procfs", None)
    try:
        return procfs.cpu_time_ns(pid) if procfs is not None else None
    except (StacklensError, OSError, ValueError, IndexError):   # gone, or not readable
        return None
