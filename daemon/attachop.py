"""One attach the daemon runs for a PID (`AttachOp`), from its first step to its end: what `ps`
shows as "attaching", what clients follow, what a detach cancels (daemon/core.py owns them)."""

from __future__ import annotations

import itertools
import os
import threading
import time

from stacklens.errors import AttachCancelled

ATTACHING = "attaching"
# Test hook, read only by tests that slow an attach on purpose: while the file this names does
# not exist, every attach waits in a step of its own ("held by ...") before it starts.
ATTACH_GATE_ENV = "STACKLENSD_TEST_ATTACH_GATE"

_OP_IDS = itertools.count(1)


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
