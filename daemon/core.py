"""The daemon's state: attached sessions by PID, discovery, optional auto-attach, counters.

Shared by the gRPC servicer, the Prometheus collector and the one-shot CLI paths. Attaching needs
root; everything here is safe to call from several gRPC worker threads (one lock around the
registry; each session's tree is touched only by its own aggregation thread). Attaches of
different PIDs run in parallel; their BCC compiles queue on one lock (bpf/program.py).

An attach is an operation the daemon owns (`AttachOp`, on a thread of its own): `ps` shows it as
"attaching" with its current step, clients follow it as long as they like (`begin_attach`,
`AttachOp.wait`) and it goes on without them; a detach of a PID being attached cancels it at its
next step (a BPF compile in progress is not interrupted), and the process ends detached.

A session is held: by `attach` (until `detach`) and by each profile window through the daemon
(`daemon/windows.py`, a lease of one client call); it is detached when its last holder lets go,
and ends with its process (a PID reused by another process ends it too).

A session that ends (detach, target exit) is retired: only its final profile and stats stay
(daemon/retired.py `Retirements`), so `stacklens report PID` works after the end.
"""

from __future__ import annotations

import collections
import inspect
import logging
import os
import re
import threading
import time
from dataclasses import dataclass
from typing import Callable

from stacklens.cct import Snapshot
from stacklens.daemon.attachop import (ATTACH_GATE_ENV, AttachOp, AttachOps, attach_error, clear_frames,
                                       program_of, shared_program_notes)
from stacklens.daemon.holds import Holds, windows_only
from stacklens.daemon.discovery import ProcFS, ProcessInfo
from stacklens.daemon import nodescan
from stacklens.daemon.overhead import Overheads
from stacklens.introspect.procfs import check_pid_range
from stacklens.daemon.retired import ClosedSession, Retirements
from stacklens.daemon.session import ProcessSession, process_start
from stacklens.errors import (AlreadyAttached, AttachCancelled, DaemonUnavailable, InputError, NoSuchProcess,
                              PermissionDenied, StacklensError, StillAttaching)
from stacklens.textsafe import safe_text

log = logging.getLogger(__name__)

MAX_SESSIONS = 64
PF_KTHREAD = 0x00200000         # /proc/PID/stat flags: a kernel thread


_CAPS = ("chown", "dac_override", "dac_read_search", "fowner", "fsetid", "kill", "setgid", "setuid", "setpcap",
         "linux_immutable", "net_bind_service", "net_broadcast", "net_admin", "net_raw", "ipc_lock", "ipc_owner",
         "sys_module", "sys_rawio", "sys_chroot", "sys_ptrace", "sys_pacct", "sys_admin", "sys_boot", "sys_nice",
         "sys_resource", "sys_time", "sys_tty_config", "mknod", "lease", "audit_write", "audit_control", "setfcap",
         "mac_override", "mac_admin", "syslog", "wake_alarm", "block_suspend", "audit_read", "perfmon", "bpf",
         "checkpoint_restore")


def _caps(procfs: ProcFS, pid: int, field: str) -> int | None:
    try:
        return int(procfs.status(pid)[field], 16)
    except (StacklensError, OSError, ValueError, KeyError):
        return None


def _why_hidden(pid: int, procfs: ProcFS) -> str:
    """What is known of why the kernel hides a process from root: the capabilities it holds
    that this process lacks (the kernel's ptrace check wants them all), else the other causes."""
    theirs, ours = _caps(procfs, pid, "CapPrm"), _caps(procfs, os.getpid(), "CapEff")
    if theirs is not None and ours is not None and theirs & ~ours:
        extra = [f"cap_{_CAPS[b]}" if b < len(_CAPS) else f"capability {b}"
                 for b in range(64) if (theirs & ~ours) >> b & 1]
        return (f"it holds capabilities that this process lacks ({', '.join(extra)}), and a security "
                "module (SELinux, a BPF LSM) or another PID/user namespace may guard it too")
    return ("it is not dumpable, or a security module (SELinux, a BPF LSM), a Yama ptrace policy or "
            "another PID/user namespace guards it")


def check_target(pid: int, procfs: ProcFS | None = None, *, who: str = "stacklens") -> None:
    """Refuses what cannot be profiled, with the reason, before any work: zombies and exiting
    processes, kernel threads, and processes whose /proc the kernel hides even from root (with
    why, as far as /proc tells). `who` names the caller in the message."""
    check_pid_range(pid)
    procfs = procfs or ProcFS()
    comm, fields = procfs.stat(pid)  # NoSuchProcess when it does not exist
    # the state first: a zombie, like a kernel thread, has no cmdline and no exe
    if fields and fields[0] in ("Z", "X"):
        raise NoSuchProcess(f"process {pid} has exited (zombie); nothing to attach to")
    flags = int(fields[6]) if len(fields) > 6 and fields[6].isdigit() else 0
    if flags & PF_KTHREAD:  # the kernel's own mark; a PID 2 in a container is a user process
        name = safe_text(comm)  # the comm is the target's to choose
        raise InputError(f"PID {pid} ({name}) is a kernel thread: only user processes can be profiled "
                         "(see `stacklens ps`)")
    if not _cmdline(procfs, pid) and not _has_exe(procfs, pid):  # mm already released: exiting
        raise NoSuchProcess(f"process {pid} is exiting; nothing to attach to")
    try:
        procfs.read(pid, "maps")
    except PermissionDenied:
        if os.geteuid() != 0:
            raise
        raise PermissionDenied(
            f"the kernel refuses {who} (root) access to /proc/{pid}/maps, so it cannot be profiled from "
            f"here: the process is protected; {_why_hidden(pid, procfs)}") from None


def _cmdline(procfs: ProcFS, pid: int) -> str:
    try:
        return procfs.read(pid, "cmdline")
    except PermissionDenied:
        return "?"


def _comm(procfs: ProcFS, pid: int) -> str:
    """The process's name, escaped (the target's to choose), or "" when it cannot be read."""
    try:
        return safe_text(procfs.stat(pid)[0])
    except (StacklensError, OSError, IndexError):
        return ""


def _has_exe(procfs: ProcFS, pid: int) -> bool:
    try:
        return bool(procfs.exe_strict(pid))
    except PermissionDenied:
        return True
    except NoSuchProcess:
        return False


# CPython builds whose BPF program the daemon compiles at start (bpf/shared.py keeps two idle)
WARM_UP_BUILDS = 2
CANCEL_WAIT_S = 90.0        # a detach waits this long for the attach it cancels (client: 120 s)


def _takes_progress(start) -> bool:
    """Whether a session's start() takes `progress` (sessions of tests may not)."""
    try:
        return "progress" in inspect.signature(start).parameters
    except (TypeError, ValueError):
        return False


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
        self.warmer = nodescan.WarmUp(prepare)   # programs compiled ahead (daemon/nodescan.py)
        self.sessions: dict[int, ProcessSession] = {}
        self.holds = Holds()   # who holds each session: "attach", "window N" (daemon/holds.py)
        self.retired = Retirements(self._lock)   # ended sessions, kept for `report` and `ps`
        self.closed = self.retired.closed
        self._factory = session_factory
        self.procfs = procfs or ProcFS()
        self.auto_attach = auto_attach
        self.max_nodes = max_nodes
        self.counters = collections.Counter()
        self.started = time.time()
        self._closing = False
        self.ops = AttachOps()
        self.attaching = self.ops.running   # PID -> its attach in progress
        self._gate = os.environ.get(ATTACH_GATE_ENV) or None   # tests only: see ATTACH_GATE_ENV
        self.overheads = Overheads()     # the probes' estimated cost to each session (`ps`)

    def _check_target(self, pid: int) -> None:
        if pid == os.getpid():
            raise InputError(f"PID {pid} is stacklensd itself: attach to the process you want to profile")
        check_target(pid, self.procfs, who="stacklensd")

    def begin_attach(self, pid: int, *, agent: bool = False, cpu_hz: int = 99, ops: bool = True,
                     join: bool = False, holder: str = "attach") -> tuple[AttachOp, bool]:
        """Starts the attach of `pid` on a thread of the daemon's own and returns at once:
        (the operation, False); `holder` holds the session once it is attached. With `join`, an
        attach of `pid` in progress with the same options is returned instead: (it, True). A
        session held by others (a profile window) is held by `holder` too: (an ended op saying
        so, True). What cannot be attached is refused here, before any work."""
        check_pid_range(pid)
        if not 1 <= cpu_hz <= 10_000:
            raise InputError(f"cpu sample rate {cpu_hz} Hz out of range (1..10000)")
        self._check_target(pid)
        stale = None
        with self._lock:
            if self._closing:
                raise DaemonUnavailable("stacklensd is shutting down: attach again once it is back")
            op = self.attaching.get(pid)
            if op is not None:
                if join and op.options == (agent, cpu_hz, ops) and not op.cancelled:
                    op.holders.add(holder)
                    log.info("%s joins attach %d of %d", holder, op.id, pid)
                    return op, True
                raise AlreadyAttached(f"{pid} is being attached already ({op.progress()[0]}): "
                                      f"`stacklens attach {pid}` follows it, `stacklens detach {pid}` cancels it")
            s = self.sessions.get(pid)
            if s is not None and process_start(pid, self.procfs) not in (getattr(s, "proc_start", None), None):
                stale = self.sessions.pop(pid)   # its process ended and the PID names another now
                self.holds.end(pid)
                log.info("PID %d names another process now: its old session ends", pid)
                self.retired.remember(pid, stale)
            elif s is not None:
                log.info("%s holds the session of %d too", holder, pid)
                return self._hold_attached(s, holder), True
            if len(self.sessions) + len(self.attaching) >= MAX_SESSIONS:
                raise InputError(f"at most {MAX_SESSIONS} processes can be attached at once")
            op = AttachOp(pid, agent=agent, cpu_hz=cpu_hz, ops=ops, comm=_comm(self.procfs, pid),
                          proc_start=process_start(pid, self.procfs))
            op.holders.add(holder)
            self.attaching[pid] = op
            log.info("%s begins attach %d of %d", holder, op.id, pid)
        if stale is not None:
            stale.stop("exited")
            self._retire(stale)
        threading.Thread(target=self._run_attach, args=(op,), name=f"stacklens-attach-{pid}", daemon=True).start()
        return op, False

    def _hold_attached(self, s: ProcessSession, holder: str) -> AttachOp:
        """Under the lock: `holder` holds the attached session `s` too; an ended op says so."""
        others = self.holds.add(s.pid, holder)
        op = AttachOp(s.pid, agent=bool(getattr(s, "want_agent", False)), cpu_hz=getattr(s, "cpu_hz", 0),
                      ops=getattr(s, "ops", True), comm=getattr(s, "comm", ""), proc_start=getattr(s, "proc_start", None))
        op.end(notes=[f"attached already (held by {', '.join(others) or 'nothing'}): held by this {holder} too"])
        self.ops.keep(op)
        return op

    def release(self, pid: int, holder: str) -> None:
        """`holder` lets go of `pid`'s session (or of its attach in progress); the last to let go
        detaches it (cancels the attach)."""
        with self._lock:
            op = self.attaching.get(pid)
            if op is not None and holder in op.holders:
                op.holders.discard(holder)
                if not op.holders:
                    op.cancel()
                return
            if not self.holds.let_go(pid, holder):
                return
        log.info("%s let go of %d, the last holder: detaching it", holder, pid)
        try:
            self.detach(pid, force=True)
        except NoSuchProcess:
            pass

    def held_by(self, pid: int) -> list[str]:
        """Who holds `pid`'s session now (`ps`), sorted; a copy taken under the lock."""
        with self._lock:
            return self.holds.of(pid)

    def attach(self, pid: int, *, agent: bool = False, cpu_hz: int = 99, ops: bool = True) -> list[str]:
        """`begin_attach`, then waits for the attach's end: its notes, or its error raised."""
        op, _ = self.begin_attach(pid, agent=agent, cpu_hz=cpu_hz, ops=ops)
        op.wait()
        return op.result()

    def attach_op(self, pid: int, op_id: int) -> AttachOp:
        """The attach `op_id` of `pid`, in progress or ended (the last KEPT_ATTACH_OPS)."""
        with self._lock:
            op = self.ops.find(pid, op_id)
        if op is None:
            raise NoSuchProcess(f"stacklensd knows no attach {op_id} of {pid} (it restarted, or the attach "
                                f"ended long ago): `stacklens ps` shows the state of {pid}")
        return op

    def _run_attach(self, op: AttachOp) -> None:
        """The attach itself, on its own thread: the session made and started, then installed,
        or stopped (detached) when a detach or the daemon's stop cancelled it meanwhile."""
        pid, (agent, cpu_hz, ops) = op.pid, op.options
        s = None
        try:
            s = self._factory(pid, agent=agent, cpu_hz=cpu_hz, ops=ops, max_nodes=self.max_nodes,
                              on_close=self._closed)
            if self._gate:
                op.wait_gate(self._gate)
            op.advance("starting the session")   # where a cancel during the gate (or before) stops
            notes = s.start(progress=op.advance) if _takes_progress(s.start) else s.start()
        except BaseException as e:  # noqa: BLE001 — the outcome of the attach, kept for its clients
            with self._lock:
                self.ops.settle(op)
            if op.cancelled:
                if s is not None:     # `ps` shows it detached (its attach had begun), not "not attached"
                    self._retire_unstarted(s)
                if self._closing:
                    self._end_op(op, error=DaemonUnavailable("stacklensd stopped during this attach; nothing "
                                                             "stays attached: attach again once it is back"))
                else:
                    self.counters["attach_cancels"] += 1
                    self._end_op(op, error=AttachCancelled(f"the attach of {pid} was cancelled by a detach at its "
                                                           f"step '{op.phase}'; nothing stays attached"))
            else:
                self.counters["attach_failures"] += 1
                self._end_op(op, error=attach_error(op, e, process_start(pid, self.procfs)))
            s = None   # the error's traceback holds this frame: it must not hold the session too
            return
        with self._lock:
            self.ops.settle(op)
            closing, cancelled = self._closing, op.cancelled
            if not (closing or cancelled):
                self.sessions[pid] = s
                self.holds.begin(pid, op.holders)
                self.overheads.start(s)
                log.info("attach %d of %d installed, held by %s", op.id, pid, sorted(op.holders))
        if closing or cancelled:   # the daemon stopped, or a detach came, while this attach ran
            s.stop("detached")
            with self._lock:
                self.retired.remember(pid, s)
            self._retire(s)
            if closing:
                self._end_op(op, error=DaemonUnavailable("stacklensd is shutting down: attach again once it is back"))
            else:
                self.counters["attach_cancels"] += 1
                self._end_op(op, error=AttachCancelled(
                    f"the attach of {pid} was cancelled by a detach as it ended; it was detached again"))
            return
        notes = self._count_sharers(s, notes)
        self.counters["attaches"] += 1
        self._end_op(op, notes=notes)

    def _end_op(self, op: AttachOp, *, notes: list[str] | None = None, error: BaseException | None = None) -> None:
        """Ends `op` and keeps it (the last KEPT_ATTACH_OPS) for the clients that follow it; the
        frames of its error's traceback lose their locals (the session and what it held)."""
        clear_frames(error)
        with self._lock:
            self.ops.keep(op)
        op.end(notes=notes, error=error)

    def _retire_unstarted(self, s: ProcessSession) -> None:
        """A session whose start was cancelled: kept as closed (detached) for `ps` and `report`."""
        try:
            s.stop("detached")
        except Exception:  # noqa: BLE001 — its start already tore down what it had set up
            log.exception("stop of the cancelled session of %d", s.pid)
        with self._lock:
            if s.pid not in self.sessions:
                self.retired.remember(s.pid, s)
        self._retire(s)

    def _count_sharers(self, s: ProcessSession, notes: list[str]) -> list[str]:
        """The notes of attached `s`, its BPF program's users counted now (attachop.py)."""
        prog = program_of(s)
        if prog is None:
            return notes
        return shared_program_notes(s, notes, sum(1 for o in self.active() if o is not s and program_of(o) is prog))

    def _retire(self, s: ProcessSession) -> None:
        """Replaces an ended session by its ClosedSession and gives the memory back."""
        self.overheads.end(s)
        self.retired.retire(s)

    def tidy(self) -> None:
        """Gives the memory of retired sessions back to the OS (daemon/retired.py)."""
        self.retired.tidy()

    def _closed(self, s: ProcessSession) -> None:
        """on_close of a session (its aggregation thread, at target exit)."""
        with self._lock:
            mine = self.sessions.get(s.pid) is s
            if mine:
                del self.sessions[s.pid]
                self.holds.end(s.pid)
                self.retired.remember(s.pid, s)
        self.counters["sessions_closed"] += 1
        log.info("session %d (%s) ended: %s", s.pid, getattr(s, "comm", "") or "?", s.state)
        if mine:   # retired once this thread has ended; session() waits for that
            self.retired.retire_after(s, threading.current_thread(), self._retire)

    def detach(self, pid: int, *, cancel_wait_s: float = CANCEL_WAIT_S, force: bool = False) -> str:
        """Detaches `pid`, or cancels its attach in progress (waiting up to `cancel_wait_s` for
        the attach to stop at its next step). Returns what happened, in a line. A session that
        profile windows hold too stays for them (their leases end it), unless `force`."""
        with self._lock:
            op = self.attaching.get(pid)
            windows = [] if force else windows_only(op.holders if op is not None else self.holds.held(pid))
            if windows:
                return (f"{pid} stays attached while {', '.join(windows)} of `stacklens profile` hold"
                        f"{'s' if len(windows) == 1 else ''} it: detached when {'it ends' if len(windows) == 1 else 'they end'}")
            if op is not None:
                op.cancel()          # under the lock: the attach installs its session under it too
            else:
                s = self.sessions.get(pid)
                if s is None:
                    raise NoSuchProcess(f"not attached to {pid} (see `stacklens ps`)")
                del self.sessions[pid]
                self.holds.end(pid)
        if op is not None:
            if op.wait(timeout=cancel_wait_s):
                return f"cancelled the attach of {pid} (at step '{op.phase}'); nothing stays attached"
            return (f"cancelling the attach of {pid}: it stops when its current step ('{op.phase}') ends, "
                    "and nothing stays attached")
        log.info("detaching %d%s", pid, "" if force else " (asked)")
        s.stop("detached")
        with self._lock:
            self.retired.remember(pid, s)
        self.counters["detaches"] += 1
        self._retire(s)
        return f"detached from {pid}"

    def session(self, pid: int) -> ProcessSession | ClosedSession:
        self.retired.wait_retired(pid)   # a session that just ended: its ClosedSession is being made
        with self._lock:
            op = self.attaching.get(pid)
            s = self.sessions.get(pid) or (None if op is not None else self.closed.get(pid))
        if s is None and op is not None:
            phase, phase_s, _ = op.progress()
            raise StillAttaching(f"{pid} is still being attached ({phase}, {phase_s:.0f}s in this step): its "
                                 f"profile begins when the attach ends; `stacklens attach {pid}` follows it")
        if s is None:
            raise NoSuchProcess(f"not attached to {pid}: attach first (`stacklens attach {pid}`)")
        return s

    def snapshot(self, pid: int, window_s: float | None = None) -> Snapshot:
        return self.session(pid).snapshot(window_s=window_s)

    def node_stats(self) -> collections.Counter[str]:
        """Session stats summed over every session since start (the retired ones' final stats,
        then the live ones' current stats), plus the daemon's counters (attaches, detaches, ...).
        Read in that order, a session retiring meanwhile is missed once, never counted twice."""
        out = self.retired.stats()
        for s in self.active():
            try:
                out.update(s.stats())
            except StacklensError:
                continue
        out.update(self.counters)
        return out

    def active(self) -> list[ProcessSession]:
        with self._lock:
            return list(self.sessions.values())

    def held_now(self) -> tuple[dict, dict]:
        """Copies, taken together: (PID -> its session or attach in progress, PID -> closed)."""
        with self._lock:
            return {**self.attaching, **self.sessions}, dict(self.closed)

    def warm_up(self, limit: int = WARM_UP_BUILDS) -> int:
        """Compiles ahead the programs the torch/JAX processes running now would need
        (daemon/nodescan.py WarmUp); how many CPython builds it prepared now."""
        return self.warmer.run(self, limit)

    def warm_up_done(self, limit: int = WARM_UP_BUILDS) -> bool:
        """Nothing (more) to compile ahead: no warm-up, or `limit` builds prepared."""
        return self.warmer.done(limit)

    def auto_attach_scan(self) -> list[int]:
        """Attaches to the processes the auto-attach rule matches (daemon/nodescan.py)."""
        return nodescan.auto_attach_scan(self)

    def knows(self, pid: int) -> bool:
        """`pid` is attached, or being attached."""
        with self._lock:
            return pid in self.sessions or pid in self.attaching

    @property
    def closing(self) -> bool:
        return self._closing

    def close(self) -> None:
        """Refuses new attaches from now on; an attach in flight stops its session when it ends."""
        with self._lock:
            self._closing = True

    def shutdown(self) -> None:
        """close(), cancels the attaches in progress (each stops at its next step), then detaches
        every session."""
        self.close()
        with self._lock:
            ops = list(self.attaching.values())
        for op in ops:
            op.cancel()
        for s in self.active():
            try:
                self.detach(s.pid, force=True)
            except NoSuchProcess:
                pass
