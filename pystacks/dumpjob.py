"""`stacklens dump --job LAUNCHER_PID`: dump every rank of a torch.distributed job and say which
ranks wait in a collective and which rank is missing.

The ranks are the launcher's descendants whose environment sets RANK (torchrun sets RANK,
LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE in each worker's; a rank's own children inherit them and
are not ranks). Each is dumped by pystacks/dump.py (nonblocking, no agent). The analysis
(`analyze`) is pure: ranks and their dumps in, `JobDump` out, tested on fakes behind `JobHost`.

Requires what pystacks/dump.py requires (root / CAP_SYS_PTRACE); reads /proc/*/stat once to find
the launcher's descendants (a few ms) and /proc/PID/environ of each.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from stacklens.introspect.ranks import ProcRankHost, RankHost, RankProc, find_ranks, parse_environ
from stacklens.errors import StacklensError
from stacklens.pystacks.dump import ProcessDump, PyFrameText, dump_process

# torch.distributed entry points that block until every rank joins (and Work.wait on them)
COLLECTIVES = frozenset({
    "all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "reduce_scatter",
    "reduce_scatter_tensor", "broadcast", "broadcast_object_list", "barrier", "monitored_barrier",
    "reduce", "all_to_all", "all_to_all_single", "gather", "gather_object", "scatter",
    "scatter_object_list", "send", "recv", "isend", "irecv", "batch_isend_irecv", "wait",
    "all_reduce_coalesced", "all_gather_coalesced", "new_group", "init_process_group",
})
DIST_DIR = "torch/distributed/"


class JobHost(RankHost, Protocol):
    """What finding and dumping the ranks needs from the machine (fakes in tests)."""

    def dump(self, pid: int) -> ProcessDump: ...


class ProcJobHost(ProcRankHost):
    """`JobHost` over /proc (introspect/ranks.py) and pystacks/dump.py."""

    def dump(self, pid: int) -> ProcessDump:
        return dump_process(pid, self.procfs)


def collective_frame(dump: ProcessDump) -> tuple[PyFrameText, PyFrameText | None] | None:
    """(the collective's frame, the first caller outside torch.distributed) of the first thread,
    main thread first, that waits in a torch.distributed collective; None if none does."""
    threads = sorted(dump.threads, key=lambda t: not t.main)
    for t in threads:
        for i, f in enumerate(t.frames):            # innermost first
            name = f.function.rsplit(".", 1)[-1]
            if DIST_DIR in f.file.replace("\\", "/") and name in COLLECTIVES:
                caller = next((g for g in t.frames[i + 1:]
                               if DIST_DIR not in g.file.replace("\\", "/")), None)
                return f, caller
    return None


@dataclass(frozen=True)
class RankDump:
    rank: RankProc
    dump: ProcessDump | None
    error: str = ""
    collective: PyFrameText | None = None
    caller: PyFrameText | None = None


@dataclass(frozen=True)
class JobDump:
    launcher: int
    world_size: int | None
    ranks: tuple[RankDump, ...]
    missing: tuple[tuple[int, str], ...]      # (rank, why)
    notes: tuple[str, ...] = ()

    def waiting(self) -> list[int]:
        return [r.rank.rank for r in self.ranks if r.collective is not None]

    def to_json(self) -> dict:
        def frame(f: PyFrameText | None) -> dict | None:
            return None if f is None else {"file": f.file, "function": f.function, "line": f.line}
        return {
            "launcher": self.launcher, "world_size": self.world_size,
            "waiting_in_collective": self.waiting(),
            "missing": [{"rank": r, "why": why} for r, why in self.missing],
            "notes": list(self.notes),
            "ranks": [{"rank": r.rank.rank, "pid": r.rank.pid, "local_rank": r.rank.local_rank,
                       "error": r.error, "collective": frame(r.collective),
                       "caller": frame(r.caller),
                       "dump": r.dump.to_json() if r.dump else None} for r in self.ranks],
        }


def _expected(ranks: list[RankProc]) -> tuple[int | None, set[int], list[str]]:
    """(world size, the ranks that should be here, notes): all of WORLD_SIZE, or this node's
    LOCAL_WORLD_SIZE ranks when the job spans nodes (the others cannot be seen from here)."""
    sizes = {r.world_size for r in ranks if r.world_size is not None}
    if not sizes:
        return None, {r.rank for r in ranks}, ["no rank sets WORLD_SIZE: missing ranks cannot be told"]
    world = max(sizes)
    notes = [f"ranks disagree on WORLD_SIZE: {sorted(sizes)}"] if len(sizes) > 1 else []
    local = {r.local_world_size for r in ranks if r.local_world_size is not None}
    if local and max(local) < world:
        lws = max(local)
        bases = {r.rank - r.local_rank for r in ranks if r.local_rank is not None}
        expected = {b + i for b in bases for i in range(lws)}
        notes.append(f"WORLD_SIZE {world} spans nodes: only this node's {lws} ranks are checked")
        return world, expected, notes
    return world, set(range(world)), notes


def analyze(launcher: int, ranks: list[RankProc], dumps: dict[int, ProcessDump | str]) -> JobDump:
    """Pure: ranks and their dumps (or the error that stopped one) -> which wait, which is missing.
    Missing: a rank expected but with no process, or, when some ranks wait in a collective, a
    rank that does not (it never joined)."""
    out = []
    for r in ranks:
        d = dumps.get(r.pid, "not dumped")
        if isinstance(d, str):
            out.append(RankDump(r, None, error=d))
            continue
        c = collective_frame(d)
        out.append(RankDump(r, d, collective=c[0] if c else None, caller=c[1] if c else None))
    world, expected, notes = _expected(ranks)
    present = {r.rank for r in ranks}
    missing = [(k, "no process with this RANK under the launcher") for k in sorted(expected - present)]
    if any(r.collective for r in out):
        for r in out:
            if r.collective is None:
                why = (f"not dumped ({r.error})" if r.dump is None else
                       "not in a collective while the others wait in one: it never joined")
                missing.append((r.rank.rank, why))
    return JobDump(launcher, world, tuple(out), tuple(sorted(missing)), tuple(notes))


def dump_job(launcher: int, host: JobHost | None = None) -> JobDump:
    host = host or ProcJobHost()
    ranks = find_ranks(host, launcher)
    dumps: dict[int, ProcessDump | str] = {}
    for r in ranks:
        try:
            dumps[r.pid] = host.dump(r.pid)
        except StacklensError as e:
            dumps[r.pid] = str(e)
    job = analyze(launcher, ranks, dumps)
    if not ranks:
        return JobDump(launcher, None, (), (), (
            f"no process under PID {launcher} sets RANK: give the launcher's PID (torchrun)",))
    return job


__all__ = ["JobHost", "ProcJobHost", "RankProc", "RankDump", "JobDump", "find_ranks",
           "collective_frame", "analyze", "dump_job", "parse_environ"]
