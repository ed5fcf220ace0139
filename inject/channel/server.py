"""The daemon's end of the agent channel: a Unix socket per target, strict parsing into records.

Runs as root. The socket lives in a root-owned directory that is not writable by others (mode
0600, or 0660 with the target's group when the target is not root; ``agentdir.py``), and only a
peer whose SO_PEERCRED pid is the target is served. Everything the agent sends is treated as
hostile: bounded frame size, strict types and ranges per message kind (``messages.py``; GPU
messages by their vendor's decoder, ``gpu/``), unknown kinds rejected; every rejection is counted
(``stats()``) and the server keeps running. Nothing received is executed.
One reader thread per server; records wait in a deque bounded by count and by estimated bytes
(``MAX_QUEUED_BYTES``; drops counted ``dropped_records`` / ``dropped_bytes``) until ``poll()``.
"""

from __future__ import annotations

import collections
import json
import os
import secrets
import socket
import struct
import threading
import time
from pathlib import Path

from stacklens.errors import AttachError, InputError
from stacklens.inject.agent import wire
from stacklens.inject.channel.agentdir import (clean_stale, default_socket_dir, dir_lock, open_socket_dir, remove_files,
                                               take_pid_lock)
from stacklens.inject.channel.gpu import Connection, route
from stacklens.inject.channel.gpu.cupti import NameReader
from stacklens.inject.channel.messages import KNOWN_KINDS, parse_message
from stacklens.inject.channel.validate import ProtocolError
from stacklens.inject.channel.validate import check_int as _int, check_row as _row, check_text as _str
from stacklens.inject.rootpath import remove_tree
from stacklens.introspect.procfs import ProcFS
from stacklens.records.agent import AgentHello

AGENT_SRC = Path(__file__).parents[1] / "agent"
AGENT_PACKAGES = ("gpu",)   # folders of AGENT_SRC copied with it (one level, *.py only)
RAW_KIND = "cupti_raw"      # the kind of a raw frame (wire.RAW_MAGIC): CUPTI's buffers, the only ones so far
# Bytes the records waiting for poll() may hold (estimated: a message's length, plus RECORD_BYTES
# a record and messages.FRAME_BYTES a Python frame beyond its strings). Part of a session's memory
# budget (issue 17): 64 MiB here + the tree's (cct/window.py DEFAULT_MAX_BYTES) = 256 MiB a session.
MAX_QUEUED_BYTES = 64 << 20
RECORD_BYTES = 160          # a slotted record object, its ints, the deque slots

# servers by socket path, so inject_agent(pid, socket_path=srv.path) can wait for the hello
_REGISTRY: dict[str, "AgentServer"] = {}
_REGISTRY_LOCK = threading.Lock()


class AgentServer:
    def __init__(self, pid: int, socket_dir: Path | str | None = None, *, config: dict | None = None,
                 max_records: int = 250_000, max_queued_bytes: int = MAX_QUEUED_BYTES) -> None:
        if type(pid) is not int or pid <= 0:
            raise InputError(f"bad PID {pid!r}")
        self.pid = pid
        self.config = dict(config or {})
        self._stats = collections.Counter()
        self.dir = Path(socket_dir) if socket_dir is not None else default_socket_dir(pid)
        tstat = ProcFS().owner(pid)             # NoSuchProcess when it is gone
        # every file below is created relative to this descriptor, never by a path through the
        # target's root (a symlink there would lead the daemon anywhere on the host: rootpath.py)
        self._dirfd, target_dir = open_socket_dir(pid, self.dir, tstat)
        self._codefd = -1
        self._lock_fd = -1
        try:
            with dir_lock(self._dirfd, str(self.dir)):
                self._lock_fd = take_pid_lock(self._dirfd, pid)
                cleaned = clean_stale(self._dirfd, keep=pid)
            if cleaned:
                self._stats["stale_cleaned"] += cleaned
            self.token = secrets.token_hex(16)
            self._sock_name = f"agent-{pid}.sock"
            self._code_name = f"agent-{pid}-code"
            self.path = str(self.dir / self._sock_name)
            self.target_path = f"{target_dir}/{self._sock_name}"
            self.agent_dir = self.dir / self._code_name
            self.target_agent_dir = f"{target_dir}/{self._code_name}"
            self._install_agent()
            try:
                os.unlink(self._sock_name, dir_fd=self._dirfd)
            except FileNotFoundError:
                pass
            self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
            old = os.umask(0o177)
            try:
                # bind() takes a path: the directory's descriptor as /proc/self/fd/N, so the
                # socket lands in the directory opened above whatever its path names now
                self._listener.bind(f"{ProcFS().own_fd_path(self._dirfd)}/{self._sock_name}")
            finally:
                os.umask(old)
            if tstat.st_uid != 0:
                os.chown(self._sock_name, 0 if os.geteuid() == 0 else -1, tstat.st_gid, dir_fd=self._dirfd,
                         follow_symlinks=False)
                os.chmod(self._sock_name, 0o660, dir_fd=self._dirfd)   # our directory: no symlink there
        except BaseException:
            if self._lock_fd >= 0:
                self._remove_own_files()
            for fd in (self._codefd, self._lock_fd, self._dirfd):
                if fd >= 0:
                    os.close(fd)
            raise
        self._listener.listen(4)
        self._listener.settimeout(0.1)
        self._records: collections.deque = collections.deque()
        self._sizes: collections.deque = collections.deque()   # estimated bytes of each record
        self._queued_bytes = 0
        self._queue_lock = threading.Lock()     # the reader thread pushes, the session polls
        self._max_records = max_records
        self._max_queued_bytes = max_queued_bytes
        self._conn: socket.socket | None = None
        self._hello: AgentHello | None = None
        self._hello_event = threading.Event()
        self._gone_event = threading.Event()
        self._closing = threading.Event()
        self._send_lock = threading.Lock()
        self._flush_ids = 0             # flush requests sent (request_flush)
        self._names: NameReader | None = None   # the target's memory (kernel names, buffers read in place)
        self._link = Connection(pid)        # the current agent connection as the GPU decoders see it
        self._hello_seen = False
        self._thread = threading.Thread(target=self._serve, name=f"stacklens-agent-server-{pid}", daemon=True)
        self._thread.start()
        with _REGISTRY_LOCK:
            _REGISTRY[self.path] = self

    # -- setup ---------------------------------------------------------------------------
    def _install_agent(self) -> None:
        """Copy the agent sources to a directory the target can read and not write."""
        remove_tree(self._dirfd, self._code_name)
        os.mkdir(self._code_name, 0o755, dir_fd=self._dirfd)
        self._codefd = os.open(self._code_name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC,
                               dir_fd=self._dirfd)
        os.fchmod(self._codefd, 0o755)
        for src in sorted(AGENT_SRC.glob("*.py")):
            self.write_agent_file(src.name, src.read_bytes())
        for sub in AGENT_PACKAGES:          # one level of folders: the GPU collectors (gpu/)
            os.mkdir(sub, 0o755, dir_fd=self._codefd)
            subfd = os.open(sub, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=self._codefd)
            try:
                os.fchmod(subfd, 0o755)
                for src in sorted((AGENT_SRC / sub).glob("*.py")):
                    self._write_file(subfd, src.name, src.read_bytes())
            finally:
                os.close(subfd)

    def write_agent_file(self, name: str, data: bytes) -> str:
        """Write ``name`` (mode 0644, the daemon's) into the agent's code directory; returns its
        path as the target sees it."""
        self._write_file(self._codefd, name, data)
        return f"{self.target_agent_dir}/{name}"

    @staticmethod
    def _write_file(dirfd: int, name: str, data: bytes) -> None:
        if "/" in name or name in ("", ".", ".."):
            raise InputError(f"bad agent file name {name!r}")
        fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644,
                     dir_fd=dirfd)
        with os.fdopen(fd, "wb") as f:
            os.fchmod(fd, 0o644)
            f.write(data)

    def _remove_own_files(self) -> None:
        """Our socket, code and lock, removed under the directory's flock while our lock is still
        held (a server for this PID starting now finds either all of them or none). Where the
        flock cannot be had they stay: once our lock is closed, any later sweep removes them."""
        try:
            with dir_lock(self._dirfd, str(self.dir)):
                remove_files(self._dirfd, self.pid)
        except (AttachError, OSError):
            pass

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
            if not self._admit(conn):
                continue
            self._read_agent(conn)

    def _admit(self, conn: socket.socket) -> bool:
        try:
            cred = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
            peer_pid, _uid, _gid = struct.unpack("3i", cred)
        except OSError:
            peer_pid = -1
        if peer_pid != self.pid:
            self._stats["rejected_peer"] += 1
            conn.close()
            return False
        return True

    def _read_agent(self, conn: socket.socket) -> None:
        conn.settimeout(0.2)
        buf = bytearray()
        self._hello_seen = False
        self._link = Connection(self.pid)   # each agent connection: its own layout, its own buffers to free
        self._conn = conn
        try:
            while not self._closing.is_set():
                try:
                    data = conn.recv(1 << 16)
                except socket.timeout:
                    continue
                except OSError:
                    break
                if not data:
                    break
                buf += data
                if not self._frames(buf):
                    return
                for reply in self._link.replies():  # the buffers read in place go back to the agent
                    self._send(reply)
                if len(buf) > wire.MAX_RAW_FRAME + 4:
                    self._stats["rejected_oversize"] += 1
                    return
        finally:
            self._conn = None
            try:
                conn.close()
            except OSError:
                pass
            if self._names is not None:       # the target's memory is not held between agents
                self._names.close()
            if self._hello_seen:
                self._gone_event.set()

    def _frames(self, buf: bytearray) -> bool:
        """Handle the complete frames at the head of ``buf`` (removed from it); False when the
        connection must end (oversize, no hello, the agent's bye)."""
        while len(buf) >= 4:
            n = int.from_bytes(buf[:4], "big")
            if n > wire.MAX_FRAME:
                # only a raw CUPTI frame may be bigger than a JSON one: look at its magic
                if n > wire.MAX_RAW_FRAME or (len(buf) >= 8 and buf[4:8] != wire.RAW_MAGIC):
                    self._stats["rejected_oversize"] += 1
                    return False            # cannot resynchronise: drop the connection
            if len(buf) < 4 + n:
                break
            # one copy of the frame; both views released before buf is resized
            with memoryview(buf) as mv, mv[4:4 + n] as frame:
                raw = bytes(frame)
            del buf[:4 + n]
            self._stats["frames"] += 1
            if raw[:4] == wire.RAW_MAGIC:
                if not self._hello_seen:
                    self._stats["rejected_hello"] += 1
                    return False
                self._decode(RAW_KIND, raw, n)
                continue
            try:
                msg = json.loads(raw)
            except (ValueError, RecursionError):
                self._stats["rejected_json"] += 1
                continue
            if not self._hello_seen:
                if not self._accept_hello(msg):
                    return False
                self._hello_seen = True
                continue
            kind = msg.get("t") if type(msg) is dict else None
            if kind == "bye":
                # the agent's last message: its detach is over even while children it forked
                # (DataLoader workers) still hold a copy of its socket, so the wait ends here,
                # not at an EOF that may come much later
                self._stats["bye"] += 1
                return False
            self._decode(kind, msg, n)
        return True

    def _decode(self, kind, msg, n: int) -> None:
        """One message (a raw frame: its bytes) -> queued records. GPU messages go to the decoder
        of the vendor declaring their kind (``gpu.route``: ``VENDORS[...].decoder.decode``), the
        rest to ``parse_message``; a rejected one is counted and the connection goes on."""
        link = self._link
        counts = collections.Counter()
        try:
            vendor = route(kind, link)
            if vendor is not None:
                recs = vendor.decoder.decode(kind, msg, link)
            else:
                recs = parse_message(msg, counts, link)
        except (ProtocolError, TypeError, IndexError, KeyError, RecursionError):
            self._reject(kind)
            return
        finally:
            st = self._stats
            for k, v in link.counts.items():
                if v and k != "bytes":
                    st[k] += v
            decoded = link.counts.pop("bytes", None)
            link.counts.clear()
        if counts["truncated_strings"]:
            self._stats["truncated_strings"] += counts["truncated_strings"]
        # estimated bytes beyond the records: a decoder's own estimate (buffers: their names), else
        # the message's length and its frames'
        self._push(recs, decoded if decoded is not None else n + counts["bytes"])

    def _reject(self, kind) -> None:
        self._stats["rejected_message"] += 1
        self._stats["rejected_message:" + (kind if kind in KNOWN_KINDS else "other")] += 1

    def _accept_hello(self, msg) -> bool:
        try:
            if type(msg) is not dict or msg.get("t") != "hello" or msg.get("v") != wire.VERSION:
                raise ProtocolError("first message is not a hello")
            if msg.get("token") != self.token:
                raise ProtocolError("bad token")
            py = _row(msg.get("python"), 3)
            hello = AgentHello(_int(msg.get("pid"), 1, 1 << 31), _int(msg.get("tid"), 0, 1 << 31),
                               (_int(py[0], 0, 99), _int(py[1], 0, 99), _int(py[2], 0, 99)),
                               _str(msg.get("executable", ""), 4096))
        except (ProtocolError, TypeError):
            self._stats["rejected_hello"] += 1
            return False
        self._hello = hello
        self._gone_event.clear()
        self._push([hello])
        if self._names is not None:
            self._names.close()
        self._names = NameReader(self.pid)      # this connection's; closed when it ends
        self._link.memory = self._names
        config = dict(self.config)
        if not self._names.readable():
            # no access to /proc/PID/mem (a daemon without CAP_SYS_PTRACE in a container, a
            # non-dumpable target): buffers left in place could not be read, so they travel as
            # copies (kernel names then stay unresolved, counted)
            config["gpu_ref"] = False
            self._stats["target_memory_unreadable"] += 1
        self._send({"t": "config", **config})
        self._hello_event.set()
        return True

    def _push(self, recs: list, nbytes: int = 0) -> None:
        """Queue ``recs`` (``nbytes``: the estimated bytes of their message beyond RECORD_BYTES
        each), dropping (counted) what does not fit the count or the byte bound."""
        if not recs:
            return
        each = RECORD_BYTES + nbytes // len(recs)
        st = self._stats
        with self._queue_lock:
            for r in recs:
                if len(self._records) >= self._max_records or self._queued_bytes + each > self._max_queued_bytes:
                    st["dropped_records"] += 1
                    st["dropped_bytes"] += each
                    continue
                self._records.append(r)
                self._sizes.append(each)
                self._queued_bytes += each
                st["records"] += 1

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
        return self._conn is not None and self._hello_event.is_set() and not self._gone_event.is_set()

    @property
    def hello(self) -> AgentHello | None:
        return self._hello

    def wait_hello(self, timeout_s: float) -> bool:
        return self._hello_event.wait(timeout_s)

    def reset_hello(self) -> None:
        self._hello_event.clear()

    def poll(self, max_n: int | None = None) -> list:
        """Records received so far (at most max_n; the rest stay for the next call)."""
        with self._queue_lock:
            q = self._records
            n = len(q) if max_n is None else min(max_n, len(q))
            pop, sizes = q.popleft, self._sizes
            out = [pop() for _ in range(n)]
            self._queued_bytes -= sum(sizes.popleft() for _ in range(n))
        return out

    @property
    def queued_bytes(self) -> int:
        """Estimated bytes of the records waiting for ``poll()`` (at most MAX_QUEUED_BYTES)."""
        return self._queued_bytes

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
        if not self._hello_event.is_set():
            return True
        self._send({"t": "stop"})
        ok = self._gone_event.wait(timeout_s)
        self._hello_event.clear()
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
            if self._names is not None:
                self._names.close()
            with _REGISTRY_LOCK:
                _REGISTRY.pop(self.path, None)
            with self._queue_lock:          # what the session never polled goes now
                self._records.clear()
                self._sizes.clear()
                self._queued_bytes = 0
            self._remove_own_files()
            for fd in (self._codefd, self._lock_fd, self._dirfd):
                os.close(fd)

    def __enter__(self) -> "AgentServer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def server_for(path: str) -> AgentServer | None:
    with _REGISTRY_LOCK:
        return _REGISTRY.get(str(path))


__all__ = ["AgentServer", "server_for"]
