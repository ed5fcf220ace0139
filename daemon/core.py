"""The daemon's state: attached sessions by PID, discovery, optional auto-attach, counters.

Shared by the gRPC servicer, the Prometheus collector and the one-shot CLI paths. Attaching needs
root; everything here is safe to call from several gRPC worker threads (one lock around the
registry; each session's tree is touched only by its own aggregation thread). Attaches of
different PIDs run in parallel; their BCC compiles queue on one lock (bpf/program.py).

A session that ends (detach, target exit) is retired: its probes, agent, queues, joiner and window
buckets are dropped, and only a `ClosedSession` stays — the final cumulative profile, gzip-encoded
(typically tens of KiB), and the last stats — so `stacklens report PID` works after the end. At
most MAX_CLOSED of them (and MAX_CLOSED_BYTES of profiles) are kept, oldest dropped first; after
retirements the freed heap goes back to the OS (gc + glibc `malloc_trim`, at most once a second),
so a daemon that saw 2,000 sessions holds what one holds (tests/unit/test_daemon_core_limits.py).
"""

from __future__ import annotations

import collections
import ctypes
import ctypes.util
import gc
import logging
import os
import re
import threading
import time
from dataclasses import dataclass
from typing import Callable

from stacklens.cct import Snapshot
from stacklens.cct.export import decode_profile, encode_profile
from stacklens.daemon.discovery import ProcFS, ProcessInfo, describe_process, scan
from stacklens.daemon.session import ProcessSession, process_start
from stacklens.errors import (AlreadyAttached, DaemonUnavailable, InputError, NoSuchProcess, PermissionDenied,
                              StacklensError)
from stacklens.textsafe import safe_text

log = logging.getLogger(__name__)

MAX_SESSIONS = 64
MAX_CLOSED = 32                 # ended sessions whose final profile is kept for `report`
MAX_CLOSED_BYTES = 64 << 20     # ... and at most this many bytes of their encoded profiles
PID_MAX = 2**31 - 1             # the kernel's pid_t; pid_max itself is at most 2**22
PF_KTHREAD = 0x00200000         # /proc/PID/stat flags: a kernel thread
RELEASE_EVERY_S = 1.0


def check_pid_range(pid: int) -> None:
    """InputError unless 1 <= pid <= 2**31 - 1 (what a pid_t and the gRPC int32 field hold)."""
    if not isinstance(pid, int) or not 1 <= pid <= PID_MAX:
        raise InputError(f"invalid PID {pid}: a process id is an integer in 1..{PID_MAX} (see `stacklens ps`)")


# CPython builds whose BPF program the daemon compiles at start (bpf/shared.py keeps two idle)
WARM_UP_BUILDS = 2
# the state of a process worth profiling that no session of this daemon ever attached to
NOT_ATTACHED = "not attached"


class ClosedSession:
    """What stays of an ended session: final cumulative profile (encoded) and stats, nothing live.

    Window views are no longer meaningful once nothing is added: every `snapshot()` is the final
    cumulative profile of the session, whatever window is asked for.
    """

    agent = None

    def __init__(self, s: ProcessSession) -> None:
        self.pid = s.pid
        self.proc_start = getattr(s, "proc_start", None)
        self.comm = s.comm
        self.state = s.state if s.state not in ("attached", "starting") else "detached"
        self.started = s.started
        self.notes = list(s.notes)
        self._profile = encode_profile(s.snapshot())
        try:
            self._stats = {k: int(v) for k, v in s.stats().items()}
        except StacklensError:
            self._stats = {}

    @property
    def nbytes(self) -> int:
        return len(self._profile)

    def snapshot(self, window_s: float | None = None) -> Snapshot:
        return decode_profile(self._profile)

    def stats(self) -> dict[str, int]:
        return dict(self._stats)


def _libc_malloc_trim():
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc (musl): freed memory stays in the process
        return None


_MALLOC_TRIM = _libc_malloc_trim()


def release_memory() -> None:
    """Frees cyclic garbage and returns free heap pages to the OS (glibc keeps them otherwise)."""
    gc.collect()
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)


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
        prepare: Callable[[int], bool] | None = None,
    ) -> None:
        """``prepare(pid)``: compiles ahead what an attach to pid would compile (`warm_up`);
        None: no warm-up."""
        self._lock = threading.Lock()
        self._prepare = prepare
        self._warmed: set[str] = set()   # CPython builds whose program warm_up compiled
        self.sessions: dict[int, ProcessSession] = {}
        self.closed: collections.OrderedDict[int, ProcessSession | ClosedSession] = collections.OrderedDict()
        self._factory = session_factory
        self.procfs = procfs or ProcFS()
        self.auto_attach = auto_attach
        self.max_nodes = max_nodes
        self.counters = collections.Counter()
        # the final stats of every retired session, summed: node-wide totals that never go down
        # when a session ends (the Prometheus node counters: `node_stats`)
        self._retired_stats: collections.Counter[str] = collections.Counter()
        self.started = time.time()
        self._closing = False
        self._unreleased = 0            # sessions retired since the last release_memory()
        self._retiring: dict[int, threading.Event] = {}  # ended by themselves, being retired
        self._last_release = -RELEASE_EVERY_S

    def _check_target(self, pid: int) -> None:
        """Refuses what cannot be profiled, with the reason: the daemon itself, zombies and exiting
        processes, kernel threads, and processes whose /proc the kernel hides even from root."""
        check_pid_range(pid)
        if pid == os.getpid():
            raise InputError(f"PID {pid} is stacklensd itself: attach to the process you want to profile")
        comm, fields = self.procfs.stat(pid)  # NoSuchProcess when it does not exist
        # the state first: a zombie, like a kernel thread, has no cmdline and no exe
        if fields and fields[0] in ("Z", "X"):
            raise NoSuchProcess(f"process {pid} has exited (zombie); nothing to attach to")
        flags = int(fields[6]) if len(fields) > 6 and fields[6].isdigit() else 0
        if flags & PF_KTHREAD:  # the kernel's own mark; a PID 2 in a container is a user process
            name = safe_text(comm)  # the comm is the target's to choose
            raise InputError(f"PID {pid} ({name}) is a kernel thread: only user processes can be profiled "
                             "(see `stacklens ps`)")
        if not self._cmdline(pid) and not self._has_exe(pid):  # mm already released: exiting
            raise NoSuchProcess(f"process {pid} is exiting; nothing to attach to")
        try:
            self.procfs.read(pid, "maps")
        except PermissionDenied:
            if os.geteuid() != 0:
                raise
            raise PermissionDenied(
                f"the kernel refuses stacklensd (root) access to /proc/{pid}/maps: the process is protected "
                "(not dumpable, a Yama ptrace policy, an LSM, or another PID/user namespace's init); "
                "it cannot be profiled from here") from None

    def _cmdline(self, pid: int) -> str:
        try:
            return self.procfs.read(pid, "cmdline")
        except PermissionDenied:
            return "?"

    def _has_exe(self, pid: int) -> bool:
        try:
            return bool(self.procfs.exe_strict(pid))
        except PermissionDenied:
            return True
        except NoSuchProcess:
            return False

    def attach(self, pid: int, *, agent: bool = False, cpu_hz: int = 99, ops: bool = True) -> list[str]:
        self._check_target(pid)
        if not 1 <= cpu_hz <= 10_000:
            raise InputError(f"cpu sample rate {cpu_hz} Hz out of range (1..10000)")
        with self._lock:
            if self._closing:
                raise DaemonUnavailable("stacklensd is shutting down: attach again once it is back")
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
            closing = self._closing
            if not closing:
                self.sessions[pid] = s
        if closing:  # shutdown() ran while this attach compiled: nothing may stay attached
            s.stop("detached")
            with self._lock:
                self.sessions.pop(pid, None)
            raise DaemonUnavailable("stacklensd is shutting down: attach again once it is back")
        self.counters["attaches"] += 1
        return notes

    def _remember(self, key: int, rec: ProcessSession | ClosedSession) -> None:
        """Keeps `rec` as the closed session of `key` (under the lock), within the caps."""
        self.closed[key] = rec
        self.closed.move_to_end(key)
        total = sum(getattr(r, "nbytes", 0) for r in self.closed.values())
        while len(self.closed) > MAX_CLOSED or (total > MAX_CLOSED_BYTES and len(self.closed) > 1):
            _, old = self.closed.popitem(last=False)
            total -= getattr(old, "nbytes", 0)

    def _retire(self, s: ProcessSession) -> None:
        """Replaces an ended session by its ClosedSession and gives the memory back."""
        try:
            rec = ClosedSession(s)
        except Exception:  # noqa: BLE001 — the final profile could not be made: keep nothing
            log.exception("final profile of session %d", s.pid)
            rec = None
        final = rec.stats() if rec is not None else {}
        with self._lock:
            self._retired_stats.update(final)
            if self.closed.get(s.pid) is s:
                if rec is None:
                    del self.closed[s.pid]
                else:
                    self._remember(s.pid, rec)
        del s, rec
        with self._lock:
            self._unreleased += 1
            due = time.monotonic() - self._last_release >= RELEASE_EVERY_S
        if due:
            self.tidy()

    def tidy(self) -> None:
        """Gives the memory of retired sessions back to the OS (at most once per RELEASE_EVERY_S
        from `_retire`, a full gc costs ~10-50 ms; the daemon's housekeeping calls it too)."""
        with self._lock:
            if not self._unreleased:
                return
            self._unreleased = 0
            self._last_release = time.monotonic()
        release_memory()

    def _closed(self, s: ProcessSession) -> None:
        """on_close of a session (its aggregation thread, at target exit)."""
        with self._lock:
            mine = self.sessions.get(s.pid) is s
            if mine:
                del self.sessions[s.pid]
                self._remember(s.pid, s)
        self.counters["sessions_closed"] += 1
        if mine:
            # the final profile is read once that thread has ended (it still owns the tree here,
            # and asking it for a snapshot now would wait on itself); session() waits for this
            agg = threading.current_thread()
            done = threading.Event()
            with self._lock:
                self._retiring[s.pid] = done

            def retire() -> None:
                try:
                    agg.join(timeout=30)
                    self._retire(s)
                finally:
                    with self._lock:
                        if self._retiring.get(s.pid) is done:
                            del self._retiring[s.pid]
                    done.set()

            threading.Thread(target=retire, name=f"stacklens-retire-{s.pid}", daemon=True).start()

    def detach(self, pid: int) -> None:
        with self._lock:
            s = self.sessions.get(pid)
            if s is None:
                raise NoSuchProcess(f"not attached to {pid} (see `stacklens ps`)")
            del self.sessions[pid]
        s.stop("detached")
        with self._lock:
            self._remember(pid, s)
        self.counters["detaches"] += 1
        self._retire(s)

    def session(self, pid: int) -> ProcessSession | ClosedSession:
        with self._lock:
            retiring = self._retiring.get(pid)
        if retiring is not None:
            retiring.wait(30)  # the session just ended: its ClosedSession is being made
        with self._lock:
            s = self.sessions.get(pid) or self.closed.get(pid)
        if s is None:
            raise NoSuchProcess(f"not attached to {pid}: attach first (`stacklens attach {pid}`)")
        return s

    def snapshot(self, pid: int, window_s: float | None = None) -> Snapshot:
        return self.session(pid).snapshot(window_s=window_s)

    def node_stats(self) -> collections.Counter[str]:
        """Session stats summed over every session since start (the retired ones' final stats,
        then the live ones' current stats), plus the daemon's counters (attaches, detaches, ...).
        Read in that order, a session retiring meanwhile is missed once, never counted twice."""
        with self._lock:
            out = collections.Counter(self._retired_stats)
        for s in self.active():
            try:
                out.update(s.stats())
            except StacklensError:
                continue
        out.update(self.counters)
        return out

    def active(self) -> list[ProcessSession]:
        with self._lock:
            return [s for s in self.sessions.values() if s is not None]

    def processes(self) -> list[tuple[ProcessInfo | None, ProcessSession | ClosedSession | None]]:
        """Processes worth profiling on the node (GPU, torch or JAX loaded), every attached one,
        and each with its true state: its live session, the closed session of this very process
        (detached, or its attach failed), or None (never attached). A closed session whose PID
        now names another process (another start time) is not that process's."""
        found = {p.pid: p for p in scan(self.procfs, gpu_only=False)}
        out: list[tuple[ProcessInfo | None, ProcessSession | ClosedSession | None]] = []
        with self._lock:
            sessions = {pid: s for pid, s in self.sessions.items() if s is not None}
            closed = dict(self.closed)
        for pid in sorted(set(found) | set(sessions)):
            info = found.get(pid)
            if info is None:
                try:
                    info = describe_process(pid, self.procfs)
                except Exception:  # noqa: BLE001 — exited between scan and describe
                    info = None
            s = sessions.get(pid)
            if s is None and pid in closed:
                rec = closed[pid]
                start = process_start(pid, self.procfs)
                if start is not None and start == getattr(rec, "proc_start", None):
                    s = rec
            out.append((info, s))
        return out

    def warm_up(self, limit: int = WARM_UP_BUILDS) -> int:
        """Compiles the BPF programs that the torch/JAX processes running now would need, one per
        CPython build (what a program is compiled for), for at most `limit` builds over the
        daemon's life: the first attach to such a process, or to another of the same build, then
        compiles nothing. Processes attached already are left alone. A build whose compile
        failed is not tried again (an attach will say why); a process that exited meanwhile is
        (another of its build may come). Returns how many builds it prepared now."""
        if self.warm_up_done(limit):
            return 0
        done = 0
        for info in scan(self.procfs, gpu_only=False):
            if self._closing or self.warm_up_done(limit):
                break
            with self._lock:
                attached = info.pid in self.sessions
            if attached or not info.python or info.python in self._warmed:
                continue
            try:
                if self._prepare(info.pid):
                    self.counters["warm_up_compiles"] += 1
            except NoSuchProcess:
                continue
            except Exception:  # noqa: BLE001 — counted; the attach reports the error itself
                self.counters["warm_up_failures"] += 1
            self._warmed.add(info.python)
            done += 1
        return done

    def warm_up_done(self, limit: int = WARM_UP_BUILDS) -> bool:
        """Nothing (more) to compile ahead: no warm-up, or `limit` builds prepared."""
        return self._prepare is None or len(self._warmed) >= limit

    def auto_attach_scan(self) -> list[int]:
        """Attaches to matching processes; races with Attach RPCs end in AlreadyAttached (counted)."""
        if self.auto_attach is None:
            return []
        attached = []
        for info in scan(self.procfs):
            if self._closing:
                break
            with self._lock:
                known = info.pid in self.sessions
            if known or not self.auto_attach.matches(info):
                continue
            try:
                self.attach(info.pid, agent=False)
                attached.append(info.pid)
            except AlreadyAttached:
                self.counters["auto_attach_raced"] += 1
            except Exception:  # noqa: BLE001 — counted; a bad process must not stop the scan
                self.counters["auto_attach_failures"] += 1
        return attached

    def close(self) -> None:
        """Refuses new attaches from now on; an attach in flight stops its session when it ends."""
        with self._lock:
            self._closing = True

    def shutdown(self) -> None:
        """close(), then detaches every session."""
        self.close()
        for s in self.active():
            try:
                self.detach(s.pid)
            except NoSuchProcess:
                pass
