"""The records an agent sent, waiting for the session's ``poll()``: bounded by count and by bytes.

No privilege, no I/O. The server's reader thread pushes, the session polls, under one lock. The
bytes are estimated: a message's length spread over its records, plus RECORD_BYTES a record (and
``messages.FRAME_BYTES`` a Python frame, counted by the parser into that length). What does not
fit either bound is dropped and counted (``dropped_records`` / ``dropped_bytes``), never blocked
on: a flooding agent costs the daemon at most ``max_bytes``.
"""

from __future__ import annotations

import collections
import threading

# Bytes the records waiting for poll() may hold. Part of a session's memory budget (issue 17):
# 64 MiB here + the tree's (cct/window.py DEFAULT_MAX_BYTES) = 256 MiB a session.
MAX_QUEUED_BYTES = 64 << 20
RECORD_BYTES = 160          # a slotted record object, its ints, the deque slots


class RecordQueue:
    """A FIFO of records with their estimated sizes; drops and queued records counted in ``stats``
    (the server's counter)."""

    def __init__(self, max_records: int, max_bytes: int, stats: collections.Counter) -> None:
        self._records: collections.deque = collections.deque()
        self._sizes: collections.deque = collections.deque()   # estimated bytes of each record
        self._queued_bytes = 0
        self._lock = threading.Lock()
        self._max_records = max_records
        self._max_bytes = max_bytes
        self._stats = stats

    def push(self, recs: list, nbytes: int = 0) -> None:
        """Queue ``recs`` (``nbytes``: the estimated bytes of their message beyond RECORD_BYTES
        each), dropping (counted) what does not fit the count or the byte bound."""
        if not recs:
            return
        each = RECORD_BYTES + nbytes // len(recs)
        st = self._stats
        with self._lock:
            for r in recs:
                if len(self._records) >= self._max_records or self._queued_bytes + each > self._max_bytes:
                    st["dropped_records"] += 1
                    st["dropped_bytes"] += each
                    continue
                self._records.append(r)
                self._sizes.append(each)
                self._queued_bytes += each
                st["records"] += 1

    def poll(self, max_n: int | None = None) -> list:
        """Records queued so far, oldest first (at most max_n; the rest stay for the next call)."""
        with self._lock:
            q = self._records
            n = len(q) if max_n is None else min(max_n, len(q))
            pop, sizes = q.popleft, self._sizes
            out = [pop() for _ in range(n)]
            self._queued_bytes -= sum(sizes.popleft() for _ in range(n))
        return out

    def clear(self) -> None:
        with self._lock:
            self._records.clear()
            self._sizes.clear()
            self._queued_bytes = 0

    @property
    def queued_bytes(self) -> int:
        return self._queued_bytes


__all__ = ["MAX_QUEUED_BYTES", "RECORD_BYTES", "RecordQueue"]
