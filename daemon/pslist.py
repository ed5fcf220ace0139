"""`stacklens ps` (ListProcesses): the processes worth listing on the node with what stacklensd
holds of each (`list_processes`), and a row each (`process_row`): for an attached one its rates
over the last 10 s and the probes' estimated cost to it."""

from __future__ import annotations

import time

from stacklens.daemon import stacklens_pb2 as pb
from stacklens.daemon.discovery import describe_process, scan
from stacklens.introspect.ranks import RankProc
from stacklens.daemon.session import process_start
from stacklens.errors import StacklensError

RATES_S = 10.0
# the state of a process worth profiling that no session of this daemon ever attached to
NOT_ATTACHED = "not attached"


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


def list_processes(daemon) -> list[tuple]:
    """Processes worth profiling on the node (GPU, torch or JAX loaded), every attached one and
    every one being attached, each with its true state: (what discovery saw of it, or None; its
    live session, its attach in progress, the closed session of this very process (detached, or
    its attach cancelled), or None (never attached)). A closed session whose PID now names another
    process (another start time) is not that process's; one that ended with its process (exited,
    or on an error) is listed on its own while its final profile is kept."""
    found = {p.pid: p for p in scan(daemon.procfs, gpu_only=False)}
    out: list[tuple] = []
    sessions, closed = daemon.held_now()
    # sessions that ended with their process (or on an error) stay listed while their final
    # profile is kept: `report PID` still reads it
    gone = {pid for pid, rec in closed.items()
            if pid not in found and pid not in sessions
            and (rec.state == "exited" or rec.state.startswith("error"))
            and process_start(pid, daemon.procfs) != getattr(rec, "proc_start", None)}
    for pid in sorted(set(found) | set(sessions) | gone):
        if pid in gone:
            out.append((None, closed[pid]))
            continue
        info = found.get(pid)
        if info is None:
            try:
                info = describe_process(pid, daemon.procfs)
            except Exception:  # noqa: BLE001 — exited between scan and describe
                info = None
        s = sessions.get(pid)
        if s is None and pid in closed:
            rec = closed[pid]
            start = process_start(pid, daemon.procfs)
            if start is not None and start == getattr(rec, "proc_start", None):
                s = rec
        out.append((info, s))
    return out
