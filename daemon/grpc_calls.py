"""How every gRPC call of stacklensd ends and what it may hold: errors → status, slots, grpc's log.

No privilege, no I/O but logging. Errors: a handler wrapped by ``rpc`` never calls
``context.abort`` itself; a StacklensError becomes its status code (``errors.py``), anything else
INTERNAL with a short message naming the RPC (the exception text stays in the daemon's log,
logged once with its traceback). Long-lived calls of one kind are bounded by a ``Slots``
(RESOURCE_EXHAUSTED beyond, with what to do), so unary calls never wait behind them for a worker.
Requests that do not decode are logged as one rate-limited line (``install_log_filters``).
"""

from __future__ import annotations

import functools
import inspect
import logging
import math
import threading
import time

import grpc

from stacklens.errors import StacklensError

# the service's log under the name it has always had (operators' logging configs name it)
log = logging.getLogger("stacklens.daemon.grpc_service")


class Busy(StacklensError):
    """Too many long-lived calls of one kind at once."""

    grpc_code = "RESOURCE_EXHAUSTED"


def abort(context: grpc.ServicerContext, err: StacklensError):
    context.abort(getattr(grpc.StatusCode, err.grpc_code, grpc.StatusCode.INTERNAL), str(err))


def _internal(context: grpc.ServicerContext, name: str, e: Exception):
    log.error("%s failed unexpectedly (%s)", name, type(e).__name__, exc_info=e)
    context.abort(grpc.StatusCode.INTERNAL, f"internal error in {name} ({type(e).__name__}); "
                  "see the stacklensd log and report it")


def _fail(context: grpc.ServicerContext, name: str, err: Exception) -> None:
    if isinstance(err, StacklensError):
        abort(context, err)
    _internal(context, name, err)      # a bug: INTERNAL, logged once


def rpc(fn):
    """Maps what a handler raises to a status: StacklensError → its code, anything else → INTERNAL.
    Handlers never call context.abort themselves. (The status is set outside the `except`, so the
    abort does not chain the handler's exception.)"""
    name = fn.__name__
    if inspect.isgeneratorfunction(fn):
        @functools.wraps(fn)
        def stream(self, request, context):
            try:
                yield from fn(self, request, context)
                return
            except Exception as e:  # noqa: BLE001 — mapped by _fail
                err = e
            _fail(context, name, err)

        return stream

    @functools.wraps(fn)
    def unary(self, request, context):
        try:
            return fn(self, request, context)
        except Exception as e:  # noqa: BLE001 — mapped by _fail
            err = e
        _fail(context, name, err)

    return unary


class Slots:
    """At most `n` holders at once; `take()` raises Busy(message) beyond."""

    def __init__(self, n: int, message: str) -> None:
        self.n, self.message, self.used = n, message, 0
        self._lock = threading.Lock()

    def take(self) -> None:
        with self._lock:
            if self.used >= self.n:
                raise Busy(self.message)
            self.used += 1

    def give(self) -> None:
        with self._lock:
            self.used -= 1


class _DecodeErrorFilter(logging.Filter):
    """grpc logs each request that fails to decode with a 5-line traceback: one line per
    `every_s` instead, with the number of others since."""

    def __init__(self, every_s: float = 60.0) -> None:
        super().__init__()
        self.every_s = every_s
        self._last = -math.inf
        self._skipped = 0
        self._lock = threading.Lock()

    def filter(self, record: logging.LogRecord) -> bool:
        if "deserializing" not in str(record.msg):
            return True
        with self._lock:
            now = time.monotonic()
            if now - self._last < self.every_s:
                self._skipped += 1
                return False
            self._last, skipped, self._skipped = now, self._skipped, 0
        record.msg = "malformed request: the protobuf message did not decode (INTERNAL returned)" + (
            f"; {skipped} more since the last report" if skipped else "")
        record.args = ()
        record.exc_info = None
        record.exc_text = None
        return True


_FILTER = _DecodeErrorFilter()


def install_log_filters() -> None:
    """Rate-limits grpc's log of undecodable requests (idempotent)."""
    for name in ("grpc._common", "grpc._server"):
        lg = logging.getLogger(name)
        if _FILTER not in lg.filters:
            lg.addFilter(_FILTER)


__all__ = ["Busy", "Slots", "abort", "install_log_filters", "rpc"]
