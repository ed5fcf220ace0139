"""torch.distributed ranks by their environment: whether a process is a rank, of which job, and
the ranks under a launcher (torchrun) — for `stacklens attach --job`, the rank labels of a
session (Prometheus, snapshots, `ps`) and `stacklens dump --job` (pystacks/dumpjob.py).

torchrun sets RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT and
TORCHELASTIC_RUN_ID in each worker's environment; a rank's own children (DataLoader workers,
compile workers) inherit them and are not ranks. /proc/PID/environ is the environment the process
started with: what torchrun gave it, which is what names the rank.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Protocol

from stacklens.errors import InputError, StacklensError
from stacklens.introspect.procfs import ProcFS
from stacklens.textsafe import safe_text

JOB_MAX = 256    # characters of a job's name (its rendezvous address and run id) kept


class RankHost(Protocol):
    """What finding ranks needs from the machine (fakes in tests)."""

    def children(self, pid: int) -> list[int]: ...

    def environ(self, pid: int) -> dict[str, str] | None: ...


def parse_environ(data: bytes | None) -> dict[str, str] | None:
    """NUL-separated NAME=VALUE (/proc/PID/environ) -> dict; None stays None (unreadable)."""
    if data is None:
        return None
    out = {}
    for item in data.split(b"\0"):
        name, eq, value = item.partition(b"=")
        if eq and name:
            out[name.decode(errors="replace")] = value.decode(errors="replace")
    return out


class ProcRankHost:
    """`RankHost` over /proc: the process tree read once (a few ms), environments on demand."""

    def __init__(self, procfs: ProcFS | None = None) -> None:
        self.procfs = procfs or ProcFS()
        self._kids: dict[int, list[int]] | None = None

    def children(self, pid: int) -> list[int]:
        if self._kids is None:
            kids: dict[int, list[int]] = {}
            for p in self.procfs.pids():
                try:
                    ppid = int(self.procfs.stat(p)[1][1])
                except (StacklensError, OSError, IndexError, ValueError):
                    continue          # exited while we looked
                kids.setdefault(ppid, []).append(p)
            self._kids = kids
        return sorted(self._kids.get(pid, []))

    def environ(self, pid: int) -> dict[str, str] | None:
        return parse_environ(self.procfs.environ(pid))


@dataclass(frozen=True)
class RankProc:
    rank: int
    pid: int
    local_rank: int | None
    world_size: int | None
    local_world_size: int | None
    job: str = ""       # what tells two jobs apart: TORCHELASTIC_RUN_ID and the rendezvous address

    def labels(self) -> dict[str, str]:
        """Prometheus labels: rank, local_rank, world_size ("" where not set)."""
        return {"rank": str(self.rank),
                "local_rank": "" if self.local_rank is None else str(self.local_rank),
                "world_size": "" if self.world_size is None else str(self.world_size)}

    def to_json(self) -> dict:
        return {"rank": self.rank, "pid": self.pid, "local_rank": self.local_rank,
                "world_size": self.world_size, "local_world_size": self.local_world_size, "job": self.job}


NO_RANK_LABELS = {"rank": "", "local_rank": "", "world_size": ""}


def _int(env: dict[str, str], name: str) -> int | None:
    try:
        return int(env[name])
    except (KeyError, ValueError):
        return None


def rank_of(pid: int, env: dict[str, str] | None) -> RankProc | None:
    """The rank `pid` is by its environment, or None (no RANK, or an unreadable environment)."""
    if not env:
        return None
    rank = _int(env, "RANK")
    if rank is None:
        return None
    run = env.get("TORCHELASTIC_RUN_ID", "")
    where = f"{env.get('MASTER_ADDR', '?')}:{env.get('MASTER_PORT', '?')}"
    job = f"{where} run {run}" if run else where   # the target's text: escaped and bounded
    return RankProc(rank, pid, _int(env, "LOCAL_RANK"), _int(env, "WORLD_SIZE"),
                    _int(env, "LOCAL_WORLD_SIZE"), safe_text(job[:JOB_MAX]))


def read_rank(pid: int, procfs: ProcFS | None = None) -> RankProc | None:
    """`rank_of` from /proc/PID/environ (None where it cannot be read)."""
    return rank_of(pid, parse_environ((procfs or ProcFS()).environ(pid)))


def find_ranks(host: RankHost, launcher: int) -> list[RankProc]:
    """The launcher's descendants that are ranks: the outermost process of each (job, RANK),
    breadth first (a rank's children inherit its RANK and are not searched)."""
    found: dict[tuple[str, int], RankProc] = {}
    queue = deque(host.children(launcher))
    while queue:
        pid = queue.popleft()
        r = rank_of(pid, host.environ(pid))
        if r is None:
            queue.extend(host.children(pid))
        elif (r.job, r.rank) not in found:
            found[(r.job, r.rank)] = r
    return sorted(found.values(), key=lambda r: (r.job, r.rank))


def find_job(host: RankHost, launcher: int) -> list[RankProc]:
    """The ranks of the one job under `launcher`. InputError when there are none (not a
    launcher, or its workers have not started) or when they belong to more than one job."""
    ranks = find_ranks(host, launcher)
    if not ranks:
        raise InputError(f"no process under PID {launcher} sets RANK: give the PID of the job's "
                         "launcher (torchrun), or attach each rank by its own PID")
    jobs = sorted({r.job for r in ranks})
    if len(jobs) > 1:
        per = "; ".join(f"{j}: ranks {', '.join(str(r.rank) for r in ranks if r.job == j)}" for j in jobs)
        raise InputError(f"the ranks under PID {launcher} belong to {len(jobs)} jobs ({per}): give "
                         "the launcher of one job")
    return ranks


__all__ = ["RankHost", "ProcRankHost", "RankProc", "NO_RANK_LABELS", "parse_environ", "rank_of",
           "read_rank", "find_ranks", "find_job"]
