"""Requests to a session's aggregation thread (`RequestDesk`): the only thread that writes its
tree also answers what reads it (snapshots, stats, what is in flight, a window's edges), between
two polls, so a reader never sees a tree half-written and never takes a lock the join would wait on.

A request is queued only while the thread takes requests (checked and queued under one lock);
once it has stopped taking them, the caller runs its request itself (the tree is no longer
written): none waits for a thread that has gone.
"""

from __future__ import annotations

import concurrent.futures
import queue
import threading
from typing import Any, Callable

from stacklens.errors import StacklensError


class RequestDesk:
    def __init__(self, pid: int) -> None:
        self.pid = pid
        self._queue: queue.Queue[tuple[concurrent.futures.Future, Callable[[], Any]]] = queue.Queue()
        self.lock = threading.Lock()
        self.open = False          # the aggregation thread takes requests (set by `opened`)

    def opened(self) -> None:
        """The aggregation thread has started: requests are queued for it from now on."""
        with self.lock:
            self.open = True

    def close(self) -> None:
        """The thread takes no more requests: later callers run theirs themselves."""
        with self.lock:
            self.open = False

    def call(self, fn: Callable[[], Any], timeout: float = 10.0) -> Any:
        """`fn()` on the aggregation thread (by the caller once it has ended); its result."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self.lock:
            queued = self.open
            if queued:
                self._queue.put((fut, fn))
        if not queued:
            return fn()
        try:
            return fut.result(timeout=timeout)
        except concurrent.futures.TimeoutError:
            raise StacklensError(f"session {self.pid} did not answer within {timeout}s") from None

    def serve(self) -> None:
        """On the aggregation thread: every request queued so far, answered."""
        while True:
            try:
                fut, fn = self._queue.get_nowait()
            except queue.Empty:
                return
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn())
                except Exception as e:  # noqa: BLE001 — the caller gets it
                    fut.set_exception(e)
