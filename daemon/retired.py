"""What stays of an ended session (`ClosedSession`: its final profile, encoded, and last stats)
and giving the freed heap back to the OS after retirements (daemon/core.py retires sessions)."""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
from typing import TYPE_CHECKING

from stacklens.cct import Snapshot
from stacklens.cct.export import decode_profile, encode_profile
from stacklens.errors import StacklensError

if TYPE_CHECKING:
    from stacklens.daemon.session import ProcessSession

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
