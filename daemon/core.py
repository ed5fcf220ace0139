"""The daemon's state: attached sessions by PID, discovery, optional auto-attach, counters.

Shared by the gRPC servicer, the Prometheus collector and the one-shot CLI paths. Attaching needs
root; everything here is safe to call from several gRPC worker threads (one lock around the
registry; each session's tree is touched only by its own aggregation thread).
"""

from __future__ import annotations

import collections
import re
import threading
import time
from dataclasses import dataclass
from typing import Callable

from stacklens.cct import Snapshot
from stacklens.daemon.discovery import ProcFS, ProcessInfo, describe_process, scan
from stacklens.daemon.session import ProcessSession
from stacklens.errors import AlreadyAttached, InputError, NoSuchProcess

MAX_SESSIONS = 64


@dataclass(frozen=True)
class AutoAttachRule:
    """Attach probes (never the agent) to GPU processes whose comm matches."""

    comm_regex: str

    def matches(self, info: ProcessInfo) -> bool:
        return info.gpu and re.search(self.comm_regex, info.comm) is not None


class Daemon:
    def __init__(
        self,
        *,
        session_factory: Callable[..., ProcessSession] = ProcessSession,
        procfs: ProcFS | None = None,
        auto_attach: AutoAttachRule | None = None,
        max_nodes: int = 100_000,
    ) -> None:
        self._lock = threading.Lock()
        self.sessions: dict[int, ProcessSession] = {}
        self.closed: collections.OrderedDict[int, ProcessSession] = collections.OrderedDict()
        self._factory = session_factory
        self.procfs = procfs or ProcFS()
        self.auto_attach = auto_attach
        self.max_nodes = max_nodes
        self.counters = collections.Counter()
        self.started = time.time()

    def attach(self, pid: int, *, agent: bool = False, cpu_hz: int = 99, ops: bool = True) -> list[str]:
        if pid <= 0:
            raise InputError(f"invalid PID {pid}")
        if not 1 <= cpu_hz <= 10_000:
            raise InputError(f"cpu sample rate {cpu_hz} Hz out of range (1..10000)")
        with self._lock:
            if pid in self.sessions:
                raise AlreadyAttached(f"already attached to {pid}; detach first (`stacklens detach {pid}`)")
            if len(self.sessions) >= MAX_SESSIONS:
                raise InputError(f"at most {MAX_SESSIONS} processes can be attached at once")
            # reserve the slot so a concurrent attach to the same PID is refused
            self.sessions[pid] = None  # type: ignore[assignment]
        try:
            s = self._factory(pid, agent=agent, cpu_hz=cpu_hz, ops=ops, max_nodes=self.max_nodes, on_close=self._closed)
            notes = s.start()
        except BaseException:
            with self._lock:
                self.sessions.pop(pid, None)
            self.counters["attach_failures"] += 1
            raise
        with self._lock:
            self.sessions[pid] = s
        self.counters["attaches"] += 1
        return notes

    def _closed(self, s: ProcessSession) -> None:
        with self._lock:
            if self.sessions.get(s.pid) is s:
                del self.sessions[s.pid]
                self.closed[s.pid] = s
                while len(self.closed) > 32:
                    self.closed.popitem(last=False)
        self.counters["sessions_closed"] += 1

    def detach(self, pid: int) -> None:
        with self._lock:
            s = self.sessions.get(pid)
            if s is None:
                raise NoSuchProcess(f"not attached to {pid} (see `stacklens ps`)")
            del self.sessions[pid]
        s.stop("detached")
        with self._lock:
            self.closed[pid] = s
        self.counters["detaches"] += 1

    def session(self, pid: int) -> ProcessSession:
        with self._lock:
            s = self.sessions.get(pid) or self.closed.get(pid)
        if s is None:
            raise NoSuchProcess(f"not attached to {pid}: attach first (`stacklens attach {pid}`)")
        return s

    def snapshot(self, pid: int, window_s: float | None = None) -> Snapshot:
        return self.session(pid).snapshot(window_s=window_s)

    def active(self) -> list[ProcessSession]:
        with self._lock:
            return [s for s in self.sessions.values() if s is not None]

    def processes(self) -> list[tuple[ProcessInfo | None, ProcessSession | None]]:
        """GPU processes on the node plus every attached one."""
        found = {p.pid: p for p in scan(self.procfs)}
        out: list[tuple[ProcessInfo | None, ProcessSession | None]] = []
        with self._lock:
            sessions = {pid: s for pid, s in self.sessions.items() if s is not None}
        for pid in sorted(set(found) | set(sessions)):
            info = found.get(pid)
            if info is None:
                try:
                    info = describe_process(pid, self.procfs)
                except Exception:  # noqa: BLE001 — exited between scan and describe
                    info = None
            out.append((info, sessions.get(pid)))
        return out

    def auto_attach_scan(self) -> list[int]:
        if self.auto_attach is None:
            return []
        attached = []
        for info in scan(self.procfs):
            if info.pid in self.sessions or not self.auto_attach.matches(info):
                continue
            try:
                self.attach(info.pid, agent=False)
                attached.append(info.pid)
            except Exception:  # noqa: BLE001 — counted; a bad process must not stop the scan
                self.counters["auto_attach_failures"] += 1
        return attached

    def shutdown(self) -> None:
        for s in self.active():
            try:
                self.detach(s.pid)
            except NoSuchProcess:
                pass
