"""Who holds each attached session: `attach` (until `detach`) and each profile window through
the daemon ("window N", a lease of one client call). The session is detached when its last
holder lets go (daemon/core.py). An attach in progress keeps its future holders itself
(`AttachOp.holders`); they hold the session from the moment it is installed.
"""

from __future__ import annotations

import logging

from stacklens.errors import AlreadyAttached

log = logging.getLogger(__name__)

ATTACH = "attach"   # the holder that `stacklens attach` makes, let go by `stacklens detach`


class Holds:
    """PID → the holders of its session. Not locked: the daemon calls it under its lock."""

    def __init__(self) -> None:
        self._of: dict[int, set[str]] = {}

    def begin(self, pid: int, holders: set[str]) -> None:
        """The session of `pid` was installed, held by `holders`."""
        self._of[pid] = set(holders)

    def end(self, pid: int) -> None:
        """The session of `pid` ended (detached, exited, replaced)."""
        self._of.pop(pid, None)

    def add(self, pid: int, holder: str) -> list[str]:
        """`holder` holds the session of `pid` too; returns who held it before, sorted."""
        held = self._of.setdefault(pid, set())
        if holder in held:
            raise AlreadyAttached(f"already attached to {pid}; detach first (`stacklens detach {pid}`)")
        others = sorted(held)
        held.add(holder)
        return others

    def let_go(self, pid: int, holder: str) -> bool:
        """`holder` lets go of the session of `pid`: True when it was the last holder."""
        held = self._of.get(pid)
        if held is None or holder not in held:
            log.info("%s lets go of %d, which it did not hold (held by %s)", holder, pid, held)
            return False
        held.discard(holder)
        if held:
            log.info("%s lets go of %d, still held by %s", holder, pid, sorted(held))
            return False
        return True

    def of(self, pid: int) -> list[str]:
        """Who holds the session of `pid`, sorted."""
        return sorted(self._of.get(pid, ()))

    def held(self, pid: int) -> set[str]:
        """The set of `pid`'s holders itself (empty when none), for `windows_only`."""
        return self._of.get(pid, set())


def windows_only(holders: set[str]) -> list[str]:
    """`attach` lets go of `holders` if others hold it too: the profile windows that still hold
    it (sorted), or [] when `attach` was alone and nothing was let go."""
    windows = sorted(holders - {ATTACH})
    if windows:
        holders.discard(ATTACH)
    return windows
