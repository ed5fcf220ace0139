"""One admitted agent connection, read until it ends: bytes → frames → hello, then messages → records.

Runs on the server's reader thread, as root. Everything read is hostile: frames are bounded
(``framing.py``), the first must be the hello (``admission.check_hello``) and nothing else is
decoded before it, each message then goes to its decoder (``dispatch.py``) and its records to the
server's bounded queue (``recordqueue.py``). A rejected message is counted and the connection goes
on; a frame over its bound, a bad hello or the agent's ``bye`` end it. Nothing received is
executed. What the decoders ask to send back (buffers read in place, to be freed) is sent after
each read. Per connection: the GPU decoders' state (``gpu.Connection``) and the reader of the
target's memory (``gpu/cupti.py``'s ``NameReader``), opened at the hello and closed at the end.
"""

from __future__ import annotations

import collections
import json
import socket
import threading
from collections.abc import Callable

from stacklens.inject.channel.admission import check_hello
from stacklens.inject.channel.dispatch import RAW_KIND, decode
from stacklens.inject.channel.framing import FrameBuffer, FrameTooLarge, is_raw
from stacklens.inject.channel.gpu import Connection
from stacklens.inject.channel.gpu.cupti import NameReader
from stacklens.inject.channel.recordqueue import RecordQueue
from stacklens.inject.channel.validate import ProtocolError
from stacklens.records.agent import AgentHello


class Presence:
    """What the server's API knows of its agent, set from the reader thread: the last hello, an
    event set once a hello has been answered (its config sent) and one set when that agent left."""

    def __init__(self) -> None:
        self.hello: AgentHello | None = None
        self.came = threading.Event()
        self.gone = threading.Event()


class AgentConnection:
    """The agent of target ``pid`` on ``sock`` (its peer already checked): ``run()`` reads it until
    it ends or ``closing`` is set; ``close()`` then lets go of the target's memory."""

    def __init__(self, sock: socket.socket, pid: int, *, token: str, config: dict, presence: Presence,
                 queue: RecordQueue, stats: collections.Counter, send: Callable[[dict], bool],
                 closing: threading.Event) -> None:
        self.sock, self.pid = sock, pid
        self.token, self.config = token, config
        self.presence, self.queue, self.stats = presence, queue, stats
        self.send, self.closing = send, closing
        self.hello_seen = False
        self.link = Connection(pid)       # this connection as the GPU decoders see it: its layout, its buffers
        self.names: NameReader | None = None    # the target's memory (kernel names, buffers read in place)
        self._frames = FrameBuffer()

    def run(self) -> None:
        self.sock.settimeout(0.2)
        while not self.closing.is_set():
            try:
                data = self.sock.recv(1 << 16)
            except socket.timeout:
                continue
            except OSError:
                return
            if not data:
                return
            self._frames.feed(data)
            if not self._take_frames():
                return
            for reply in self.link.replies():   # the buffers read in place go back to the agent
                self.send(reply)
            if self._frames.overfull():
                self.stats["rejected_oversize"] += 1
                return

    def close(self) -> None:
        if self.names is not None:       # the target's memory is not held between agents
            self.names.close()

    def _take_frames(self) -> bool:
        """Handle the complete frames received; False when the connection must end (oversize,
        no hello, the agent's bye)."""
        st = self.stats
        try:
            for raw in self._frames.frames():
                n = len(raw)
                st["frames"] += 1
                if is_raw(raw):
                    if not self.hello_seen:
                        st["rejected_hello"] += 1
                        return False
                    self.queue.push(*decode(RAW_KIND, raw, n, self.link, st))
                    continue
                try:
                    msg = json.loads(raw)
                except (ValueError, RecursionError):
                    st["rejected_json"] += 1
                    continue
                if not self.hello_seen:
                    if not self._accept_hello(msg):
                        return False
                    self.hello_seen = True
                    continue
                kind = msg.get("t") if type(msg) is dict else None
                if kind == "bye":
                    # the agent's last message: its detach is over even while children it forked
                    # (DataLoader workers) still hold a copy of its socket, so the wait ends here,
                    # not at an EOF that may come much later
                    st["bye"] += 1
                    return False
                self.queue.push(*decode(kind, msg, n, self.link, st))
        except FrameTooLarge:
            st["rejected_oversize"] += 1
            return False            # cannot resynchronise: drop the connection
        return True

    def _accept_hello(self, msg) -> bool:
        try:
            hello = check_hello(msg, self.token)
        except (ProtocolError, TypeError):
            self.stats["rejected_hello"] += 1
            return False
        p = self.presence
        p.hello = hello
        p.gone.clear()
        self.queue.push([hello])
        self.names = NameReader(self.pid)       # closed when the connection ends
        self.link.memory = self.names
        config = dict(self.config)
        if not self.names.readable():
            # no access to /proc/PID/mem (a daemon without CAP_SYS_PTRACE in a container, a
            # non-dumpable target): buffers left in place could not be read, so they travel as
            # copies (kernel names then stay unresolved, counted)
            config["gpu_ref"] = False
            self.stats["target_memory_unreadable"] += 1
        self.send({"t": "config", **config})
        p.came.set()
        return True


__all__ = ["AgentConnection", "Presence"]
