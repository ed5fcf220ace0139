"""What stays of an ended session (`ClosedSession`: its final profile, encoded, and last stats),
the ended sessions the daemon keeps (`Retirements`, within caps), and giving the freed heap back
to the OS after retirements.

A session that ends (detach, target exit) is retired: its probes, agent, queues, joiner and window
buckets are dropped, and only a `ClosedSession` stays, so `stacklens report PID` works after the
end. At most MAX_CLOSED of them (and MAX_CLOSED_BYTES of profiles) are kept, oldest dropped first;
after retirements the freed heap goes back to the OS (gc + glibc `malloc_trim`, at most once a
second), so a daemon that saw 2,000 sessions holds what one holds
(tests/unit/test_daemon_core_limits.py).
"""

from __future__ import annotations

import collections
import ctypes
import ctypes.util
import gc
import logging
import threading
import time
from typing import TYPE_CHECKING

from stacklens.cct import Snapshot
from stacklens.cct.export import decode_profile, encode_profile
from stacklens.errors import StacklensError

if TYPE_CHECKING:
    from stacklens.daemon.session import ProcessSession

log = logging.getLogger(__name__)

MAX_CLOSED = 32                 # ended sessions whose final profile is kept for `report`
MAX_CLOSED_BYTES = 64 << 20     # ... and at most this many bytes of their encoded profiles
RELEASE_EVERY_S = 1.0
RETIRE_WAIT_S = 30.0            # for an ended session's aggregation thread, and for its retirement


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


class Retirements:
    """The daemon's ended sessions: each kept as it ended, then replaced by its `ClosedSession`;
    the final stats of all of them summed; the memory they held given back.

    Shares the daemon's lock: a session leaves the daemon's live ones and is kept here in one step
    (`remember` is called under it), so a reader finds it in one place or the other at every moment.
    """

    def __init__(self, lock: threading.Lock) -> None:
        self._lock = lock
        self.closed: collections.OrderedDict[int, ProcessSession | ClosedSession] = collections.OrderedDict()
        # the final stats of every retired session, summed: node-wide totals that never go down
        # when a session ends (the Prometheus node counters)
        self._stats: collections.Counter[str] = collections.Counter()
        self._unreleased = 0            # sessions retired since the last release_memory()
        self._last_release = -RELEASE_EVERY_S
        self._retiring: dict[int, threading.Event] = {}  # ended by themselves, being retired

    def remember(self, key: int, rec: ProcessSession | ClosedSession) -> None:
        """Keeps `rec` as the closed session of `key` (under the lock), within the caps."""
        self.closed[key] = rec
        self.closed.move_to_end(key)
        total = sum(getattr(r, "nbytes", 0) for r in self.closed.values())
        while len(self.closed) > MAX_CLOSED or (total > MAX_CLOSED_BYTES and len(self.closed) > 1):
            _, old = self.closed.popitem(last=False)
            total -= getattr(old, "nbytes", 0)

    def retire(self, s: ProcessSession) -> None:
        """Replaces an ended session by its ClosedSession and gives the memory back."""
        try:
            rec = ClosedSession(s)
        except Exception:  # noqa: BLE001 — the final profile could not be made: keep nothing
            log.exception("final profile of session %d", s.pid)
            rec = None
        final = rec.stats() if rec is not None else {}
        with self._lock:
            self._stats.update(final)
            if self.closed.get(s.pid) is s:
                if rec is None:
                    del self.closed[s.pid]
                else:
                    self.remember(s.pid, rec)
        del s, rec
        with self._lock:
            self._unreleased += 1
            due = time.monotonic() - self._last_release >= RELEASE_EVERY_S
        if due:
            self.tidy()

    def retire_after(self, s: ProcessSession, thread: threading.Thread, retire) -> None:
        """`retire(s)` on a thread of its own once `thread` (the session's aggregation thread, which
        still owns the tree: asking it for a snapshot now would wait on itself) has ended;
        `wait_retired` waits for it."""
        done = threading.Event()
        with self._lock:
            self._retiring[s.pid] = done

        def run() -> None:
            try:
                thread.join(timeout=RETIRE_WAIT_S)
                retire(s)
            finally:
                with self._lock:
                    if self._retiring.get(s.pid) is done:
                        del self._retiring[s.pid]
                done.set()

        threading.Thread(target=run, name=f"stacklens-retire-{s.pid}", daemon=True).start()

    def wait_retired(self, pid: int) -> None:
        """Returns once the session of `pid` that just ended, if any, has its ClosedSession."""
        with self._lock:
            retiring = self._retiring.get(pid)
        if retiring is not None:
            retiring.wait(RETIRE_WAIT_S)

    def stats(self) -> collections.Counter[str]:
        """The final stats of the retired sessions, summed (a copy)."""
        with self._lock:
            return collections.Counter(self._stats)

    def tidy(self) -> None:
        """Gives the memory of retired sessions back to the OS (at most once per RELEASE_EVERY_S
        from `retire`, a full gc costs ~10-50 ms; the daemon's housekeeping calls it too)."""
        with self._lock:
            if not self._unreleased:
                return
            self._unreleased = 0
            self._last_release = time.monotonic()
        release_memory()
