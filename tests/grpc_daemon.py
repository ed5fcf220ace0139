"""stacklensd's gRPC server in this process, for tests: a real server on a private socket under
the test's directory, no metrics endpoint, its sessions made by a factory the test gives (fake
probes unless told otherwise, or recorded profiles). No privilege: these sessions attach to
nothing."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from stacklens.cct import export
from stacklens.daemon.core import Daemon
from stacklens.daemon.server import StacklensDaemon
from stacklens.daemon.session import ProcessSession
from tests.fakes.sources import FakeProbes


def fake_session(pid: int, **kw) -> ProcessSession:
    """A daemon session whose probes are fakes (tests/fakes/sources.py) that give nothing."""
    return ProcessSession(pid, probe_factory=lambda pid, **_: FakeProbes(pid), **kw)


class RecordedSession:
    """A daemon session that serves a recorded profile (what the daemon's sessions give: snapshot,
    stats, states); its attach says `note`."""

    agent = None

    def __init__(self, pid: int, profile: Path, note: str, **_kw) -> None:
        self.pid, self.comm, self.state, self.started, self.notes = pid, "recorded", "starting", time.time(), []
        self._snap, self._note = export.load(profile), note

    def start(self) -> list[str]:
        self.state = "attached"
        return [self._note]

    def snapshot(self, window_s: float | None = None):
        return self._snap

    def stats(self) -> dict[str, int]:
        return {"events": 0}

    def stop(self, state: str = "detached") -> None:
        self.state = state


@contextmanager
def serving(tmp: Path, session_factory: Callable[..., object] = fake_session) -> Iterator[StacklensDaemon]:
    """A started StacklensDaemon with its socket at `tmp`/run/s.sock, stopped on leaving."""
    d = StacklensDaemon(socket_path=str(tmp / "run" / "s.sock"), metrics_address=None,
                        daemon=Daemon(session_factory=session_factory))
    d.start()
    try:
        yield d
    finally:
        d.stop()
