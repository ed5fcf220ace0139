"""The daemon's end of the agent channel: a Unix socket per target, strict parsing into records.

Runs as root. The socket lives in a root-owned directory that is not writable by others (mode
0600, or 0660 with the target's group when the target is not root; ``serverfiles.py``,
``agentdir.py``), and only a peer whose SO_PEERCRED pid is the target is served, after a hello
with the server's token (``admission.py``). Everything the agent sends is treated as hostile:
bounded frame size (``framing.py``), strict types and ranges per message kind (``dispatch.py``:
``messages.py``; GPU messages by their vendor's decoder, ``gpu/``), unknown kinds rejected; every
rejection is counted (``stats()``) and the server keeps running. Nothing received is executed.
One reader thread per server, serving one connection at a time (``connection.py``); records wait
in a queue bounded by count and by estimated bytes (``recordqueue.py``: ``MAX_QUEUED_BYTES``;
drops counted ``dropped_records`` / ``dropped_bytes``) until ``poll()``.
"""

from __future__ import annotations

import collections
import secrets
import socket
import threading
import time
from pathlib import Path

from stacklens.errors import InputError
from stacklens.inject.agent import wire
from stacklens.inject.channel.admission import peer_pid
from stacklens.inject.channel.connection import AgentConnection, Presence
# RECORD_BYTES, AGENT_PACKAGES: re-exported, where they were defined before
from stacklens.inject.channel.recordqueue import MAX_QUEUED_BYTES, RECORD_BYTES, RecordQueue  # noqa: F401
from stacklens.inject.channel.serverfiles import AGENT_PACKAGES, ServerFiles  # noqa: F401
from stacklens.records.agent import AgentHello

AGENT_SRC = Path(__file__).parents[1] / "agent"     # read at each server's start (a benchmark swaps it)

# servers by socket path, so inject_agent(pid, socket_path=srv.path) can wait for the hello
_REGISTRY: dict[str, "AgentServer"] = {}
_REGISTRY_LOCK = threading.Lock()


class AgentServer:
    """The agent channel of target ``pid``: its files (``ServerFiles``), a reader thread serving
    one agent connection at a time, the records it decoded until ``poll()``, and what the daemon
    asks of its agent (``request_flush``, ``stop_agent``)."""

    def __init__(self, pid: int, socket_dir: Path | str | None = None, *, config: dict | None = None,
                 max_records: int = 250_000, max_queued_bytes: int = MAX_QUEUED_BYTES) -> None:
        if type(pid) is not int or pid <= 0:
            raise InputError(f"bad PID {pid!r}")
        self.pid = pid
        self.config = dict(config or {})
        self._stats = collections.Counter()
        self._files = files = ServerFiles(pid, socket_dir, AGENT_SRC)
        if files.cleaned:
            self._stats["stale_cleaned"] += files.cleaned
        self.token = secrets.token_hex(16)
        self.dir, self.path, self.target_path = files.dir, files.path, files.target_path
        self.agent_dir, self.target_agent_dir = files.agent_dir, files.target_agent_dir
        self._listener = files.listener
        self._listener.listen(4)
        self._listener.settimeout(0.1)
        self._queue = RecordQueue(max_records, max_queued_bytes, self._stats)  # the reader pushes, the session polls
        self._presence = Presence()
        self._conn: socket.socket | None = None
        self._agent: AgentConnection | None = None      # the last agent connection
        self._closing = threading.Event()
        self._send_lock = threading.Lock()
        self._flush_ids = 0             # flush requests sent (request_flush)
        self._thread = threading.Thread(target=self._serve, name=f"stacklens-agent-server-{pid}", daemon=True)
        self._thread.start()
        with _REGISTRY_LOCK:
            _REGISTRY[self.path] = self

    def write_agent_file(self, name: str, data: bytes) -> str:
        """Write ``name`` (mode 0644, the daemon's) into the agent's code directory; returns its
        path as the target sees it."""
        return self._files.write_agent_file(name, data)

    # -- reader thread -------------------------------------------------------------------
    def _serve(self) -> None:
        while not self._closing.is_set():
            try:
                conn, _ = self._listener.accept()
            except (socket.timeout, BlockingIOError):
                continue
            except OSError:
                if self._closing.is_set():
                    return
                time.sleep(0.05)
                continue
            if peer_pid(conn) != self.pid:
                self._stats["rejected_peer"] += 1
                conn.close()
                continue
            self._read_agent(conn)

    def _read_agent(self, conn: socket.socket) -> None:
        agent = AgentConnection(conn, self.pid, token=self.token, config=self.config, presence=self._presence,
                                queue=self._queue, stats=self._stats, send=self._send, closing=self._closing)
        self._agent = agent
        self._conn = conn
        try:
            agent.run()
        finally:
            self._conn = None
            try:
                conn.close()
            except OSError:
                pass
            agent.close()
            if agent.hello_seen:
                self._presence.gone.set()

    def _send(self, msg: dict) -> bool:
        conn = self._conn
        if conn is None:
            return False
        try:
            with self._send_lock:
                conn.sendall(wire.encode(msg))
            return True
        except OSError:
            return False

    # -- API -----------------------------------------------------------------------------
    @property
    def connected(self) -> bool:
        p = self._presence
        return self._conn is not None and p.came.is_set() and not p.gone.is_set()

    @property
    def hello(self) -> AgentHello | None:
        return self._presence.hello

    def wait_hello(self, timeout_s: float) -> bool:
        return self._presence.came.wait(timeout_s)

    def reset_hello(self) -> None:
        self._presence.came.clear()

    def poll(self, max_n: int | None = None) -> list:
        """Records received so far (at most max_n; the rest stay for the next call)."""
        return self._queue.poll(max_n)

    @property
    def queued_bytes(self) -> int:
        """Estimated bytes of the records waiting for ``poll()`` (at most MAX_QUEUED_BYTES)."""
        return self._queue.queued_bytes

    def request_flush(self) -> int | None:
        """Asks the agent to hand over every GPU record of activity completed by now (a window's
        edge); it answers with an `AgentFlushed` of this id, queued after those records. None:
        no agent is connected to ask."""
        if not self.connected:
            return None
        with self._send_lock:
            self._flush_ids += 1
            fid = self._flush_ids
        return fid if self._send({"t": "flush", "id": fid}) else None

    def stop_agent(self, timeout_s: float = 3.0) -> bool:
        """Ask the agent to detach; True once it has closed its end."""
        p = self._presence
        if not p.came.is_set():
            return True
        self._send({"t": "stop"})
        ok = p.gone.wait(timeout_s)
        p.came.clear()
        return ok

    def stats(self) -> dict:
        return dict(self._stats)

    def close(self) -> None:
        if self._closing.is_set():
            return
        try:
            self.stop_agent()
        finally:
            self._closing.set()
            try:
                self._listener.close()
            except OSError:
                pass
            self._thread.join(2.0)
            if self._agent is not None:
                self._agent.close()
            with _REGISTRY_LOCK:
                _REGISTRY.pop(self.path, None)
            self._queue.clear()         # what the session never polled goes now
            self._files.remove()
            self._files.close()

    def __enter__(self) -> "AgentServer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def server_for(path: str) -> AgentServer | None:
    with _REGISTRY_LOCK:
        return _REGISTRY.get(str(path))


__all__ = ["AgentServer", "server_for"]
