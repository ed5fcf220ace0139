"""One attach the daemon runs for a PID (`AttachOp`), from its first step to its end: what `ps`
shows as "attaching", what clients follow, what a detach cancels (daemon/core.py owns them);
the running and the ended ones, kept for their clients (`AttachOps`), and what an attach's outcome says
(`attach_error`, `shared_program_notes`)."""

from __future__ import annotations

import collections
import itertools
import os
import re
import threading
import time
import traceback

from stacklens.errors import AttachCancelled, NoSuchProcess, StacklensError

ATTACHING = "attaching"
# Test hook, read only by tests that slow an attach on purpose: while the file this names does
# not exist, every attach waits in a step of its own ("held by ...") before it starts.
ATTACH_GATE_ENV = "STACKLENSD_TEST_ATTACH_GATE"

_OP_IDS = itertools.count(1)
KEPT_ATTACH_OPS = 256       # ended attaches whose outcome a client that follows them can still fetch
SHARED_NOTE = re.compile(r"^BPF program: compiled before, shared with \d+ other .*$")


class AttachOp:
    """One attach the daemon runs for a PID, from its first step to its end: what `ps` shows as
    "attaching", what clients follow (`wait`), what a detach cancels (`cancel`). It goes on
    whether or not a client follows it; its outcome (notes, or the error) stays for those that do.

    `advance` is the session's progress callback (`ProcessSession.start(progress=...)`): each call
    begins a step, and a cancelled attach stops there (AttachCancelled goes up through the
    session's and the probes' attach, which tear down what they had set up)."""

    agent = None            # `ps`: no agent until attached

    def __init__(self, pid: int, *, agent: bool, cpu_hz: int, ops: bool, comm: str = "",
                 proc_start: int | None = None) -> None:
        self.id = next(_OP_IDS)
        self.pid = pid
        self.options = (agent, cpu_hz, ops)
        self.comm = comm
        self.proc_start = proc_start
        self.started = time.time()
        self._t0 = time.monotonic()
        self.phase = "starting"
        self._since = self._t0
        self.step = 0
        self.cancelled = False
        self.ended = False
        self.notes: list[str] = []
        self.error: BaseException | None = None
        self._tb = None
        # who waits for this attach to hold the session ("attach", "window N"): the session's
        # first holders (daemon/core.py); an attach no one holds any more is cancelled
        self.holders: set[str] = set()
        self._cv = threading.Condition()

    @property
    def state(self) -> str:
        phase, phase_s, elapsed_s = self.progress()
        return f"{ATTACHING}: {phase} ({phase_s:.0f}s in this step, {elapsed_s:.0f}s in all)"

    def progress(self) -> tuple[str, float, float]:
        """(current step, seconds in it, seconds since the attach began)."""
        with self._cv:
            now = time.monotonic()
            return self.phase, now - self._since, now - self._t0

    def advance(self, phase: str) -> None:
        """A step begins; a cancelled attach stops instead (its phase stays the step it was in)."""
        with self._cv:
            if self.cancelled:
                raise AttachCancelled(f"the attach of {self.pid} was cancelled by a detach; nothing stays attached")
            self.phase, self._since = phase, time.monotonic()
            self.step += 1
            self._cv.notify_all()

    def cancel(self) -> None:
        with self._cv:
            self.cancelled = True
            self._cv.notify_all()

    def end(self, notes: list[str] | None = None, error: BaseException | None = None) -> None:
        with self._cv:
            self.notes = list(notes or [])
            self.error, self._tb = error, (error.__traceback__ if error is not None else None)
            self.ended = True
            self._cv.notify_all()

    def wait(self, seen_step: int | None = None, timeout: float | None = None) -> bool:
        """Waits until the attach ended or, given `seen_step`, a step after it began (at most
        `timeout` seconds; None: no limit). True once the attach has ended."""
        with self._cv:
            self._cv.wait_for(lambda: self.ended or (seen_step is not None and self.step > seen_step), timeout)
            return self.ended

    def wait_gate(self, path: str) -> None:
        """The test hook (ATTACH_GATE_ENV): a step that lasts until `path` exists or a cancel."""
        self.advance(f"held by {ATTACH_GATE_ENV} until {path} exists")
        with self._cv:
            while not os.path.exists(path) and not self.cancelled:
                self._cv.wait(0.05)
        self.advance("gate open")

    def result(self) -> list[str]:
        """The notes of an attach that ended well; its error (raised) otherwise."""
        if self.error is not None:
            raise self.error.with_traceback(self._tb)
        return list(self.notes)


class AttachOps:
    """The attaches in progress by PID (`running`), and those that ended, the last
    KEPT_ATTACH_OPS, by id: a client that follows one finds it in one or the other at every
    moment. Not locked: the daemon calls it under its lock."""

    def __init__(self) -> None:
        self.running: dict[int, AttachOp] = {}
        self._ended: collections.OrderedDict[int, AttachOp] = collections.OrderedDict()

    def keep(self, op: AttachOp) -> None:
        """`op` ended (or is ending): kept for the clients that follow it."""
        self._ended[op.id] = op
        while len(self._ended) > KEPT_ATTACH_OPS:
            self._ended.popitem(last=False)

    def settle(self, op: AttachOp) -> None:
        """`op` leaves the attaches in progress and joins the kept ones in one step (it ends soon
        after: its clients wait for that)."""
        if self.running.get(op.pid) is op:
            del self.running[op.pid]
        self.keep(op)

    def find(self, pid: int, op_id: int) -> AttachOp | None:
        """The attach `op_id` of `pid`, in progress or ended."""
        op = self.running.get(pid)
        if op is None or op.id != op_id:
            op = self._ended.get(op_id)
        return op if op is not None and op.pid == pid else None


def clear_frames(error: BaseException | None) -> None:
    """The frames of `error`'s tracebacks, its causes' too, lose their locals (an attach's error
    is kept for its clients: its frames must not keep the session and what it held)."""
    seen: set[int] = set()
    e = error
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if e.__traceback__ is not None:
            traceback.clear_frames(e.__traceback__)
        e = e.__cause__ or e.__context__


def attach_error(op: AttachOp, e: BaseException, start_now: int | None) -> BaseException:
    """A failure of an attach whose process went away meanwhile (its start time is not
    `start_now` any more) says that: the probes' "no process N" or a failed read name no cause.
    Any other error is passed on as it is, and a bug stays a bug."""
    gone = op.proc_start is not None and start_now != op.proc_start
    if not gone or not isinstance(e, (StacklensError, OSError)):
        return e
    err = NoSuchProcess(f"process {op.pid} exited while stacklensd was attaching to it (at step "
                        f"'{op.phase}'); nothing was left attached")
    err.__cause__ = e
    return err


def program_of(s) -> object | None:
    """The compiled BPF program a session's probes use (bpf/shared.py SharedProgram), or None.
    ProbeSession exposes it only as `_shared`; read so the attach note counts the processes that
    share it (`shared_program_notes`)."""
    return getattr(getattr(s, "probes", None), "_shared", None)


def shared_program_notes(s, notes: list[str], others: int) -> list[str]:
    """The probes' note on a program compiled before counts the program's users when it was
    taken (a warm-up's hold and attaches still in progress included): said again of session `s`
    (its notes and its profile's), and returned, with `others`, the other attached processes
    that use it now."""
    if not any(SHARED_NOTE.match(n) for n in notes):
        return notes
    fixed = ("BPF program: compiled before, shared with "
             f"{others} other attached process{'' if others == 1 else 'es'}" if others else
             "BPF program: compiled before (compiled ahead, or kept from an earlier attach); "
             "no other attached process uses it now")

    def fix(lst: list[str]) -> list[str]:
        return [fixed if SHARED_NOTE.match(n) else n for n in lst]

    s.notes[:] = fix(s.notes)
    meta = getattr(getattr(s, "joiner", None), "meta", None)
    if isinstance(meta, dict) and isinstance(meta.get("notes"), list):
        meta["notes"] = fix(meta["notes"])    # a new list: snapshots share the old one
    return fix(notes)
