"""The Prometheus endpoint: GET /metrics over a registry (daemon/prom.py `build_registry`) on the
daemon's TCP metrics address (stacklensd `--metrics-address`), without a thread per connection.

prometheus_client's `start_http_server` spawns one thread per connection, with no timeout: 300 idle
connections from any user gave the root daemon 96 threads, and the endpoint is reachable by every
local user. `MetricsServer` instead has one selector thread that holds up to MAX_CONNECTIONS open
connections (the oldest idle one is closed to admit a new one; an idle one is closed after
IDLE_TIMEOUT_S), reads each request head itself without blocking (up to MAX_REQUEST_BYTES, within
IO_TIMEOUT_S of its first byte) and hands only complete requests to a pool of WORKERS threads, so a
client that sends a byte and stalls holds a slot, never a worker. When the process is out of file
descriptors the listener is left alone for ACCEPT_PAUSE_S rather than polled in a spin. Threads:
1 + WORKERS, whatever clients do. Serves `/` and `/metrics` (GET, HEAD; else 404 or 405); a scrape
costs what the registry's collectors cost. No privilege beyond binding the address.
"""

from __future__ import annotations

import collections
import errno
import logging
import selectors
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

log = logging.getLogger(__name__)

MAX_CONNECTIONS = 64
WORKERS = 2
IDLE_TIMEOUT_S = 10.0
IO_TIMEOUT_S = 5.0
MAX_REQUEST_BYTES = 8192
ACCEPT_PAUSE_S = 0.1            # listener off the selector after EMFILE/ENFILE


class MetricsServer:
    """GET /metrics over `registry` with bounded threads and connections (module docstring)."""

    def __init__(self, registry, host: str, port: int, *, max_connections: int = MAX_CONNECTIONS,
                 workers: int = WORKERS, idle_timeout_s: float = IDLE_TIMEOUT_S, io_timeout_s: float = IO_TIMEOUT_S) -> None:
        self.registry = registry
        self.max_connections = max_connections
        self.idle_timeout_s = idle_timeout_s
        self.io_timeout_s = io_timeout_s
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._listener = socket.socket(family, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind((host, port))
        self._listener.listen(128)
        self._listener.setblocking(False)
        self.address = self._listener.getsockname()[:2]
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="stacklens-metrics")
        # connections not handed to a worker, oldest first → deadline (not in order: a started
        # request's is earlier)
        self._idle: collections.OrderedDict[socket.socket, float] = collections.OrderedDict()
        self._heads: dict[socket.socket, bytes] = {}  # request bytes read so far, per connection
        self._accept_paused_until: float | None = None
        self._sel = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._stopping = False
        self.closed_idle = 0
        self.refused = 0
        self._busy = 0                  # connections handed to the pool and not finished
        self._busy_lock = threading.Lock()
        self._thread = threading.Thread(target=self._loop, name="stacklens-metrics-accept", daemon=True)

    def start(self) -> "MetricsServer":
        self._sel.register(self._listener, selectors.EVENT_READ)
        self._sel.register(self._wake_r, selectors.EVENT_READ)
        self._thread.start()
        return self

    def _drop(self, conn: socket.socket) -> None:
        self._idle.pop(conn, None)
        self._heads.pop(conn, None)
        try:
            self._sel.unregister(conn)
        except (KeyError, ValueError):
            pass
        conn.close()

    def _loop(self) -> None:
        while not self._stopping:
            now = time.monotonic()
            deadlines = list(self._idle.values())  # at most max_connections
            if self._accept_paused_until is not None:
                deadlines.append(self._accept_paused_until)
            timeout = max(0.0, min(deadlines) - now) if deadlines else None
            for key, _ in self._sel.select(timeout):
                sock = key.fileobj
                if sock is self._wake_r:
                    continue
                if sock is self._listener:
                    self._accept()
                    continue
                self._read_head(sock)
            now = time.monotonic()
            if self._accept_paused_until is not None and self._accept_paused_until <= now:
                self._accept_paused_until = None
                self._sel.register(self._listener, selectors.EVENT_READ)
            for conn in [c for c, t in self._idle.items() if t <= now]:
                self._drop(conn)
                self.closed_idle += 1
        for conn in list(self._idle):
            self._drop(conn)

    def _read_head(self, conn: socket.socket) -> None:
        """Reads what has arrived of `conn`'s request; a complete head goes to a worker."""
        try:
            chunk = conn.recv(4096)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            chunk = b""
        if not chunk:  # closed by the client, or reset
            self._drop(conn)
            return
        data = self._heads.get(conn, b"") + chunk
        if b"\r\n\r\n" not in data and b"\n\n" not in data:
            if len(data) > MAX_REQUEST_BYTES:
                self._drop(conn)
                return
            if conn not in self._heads:  # the request has started: it has IO_TIMEOUT_S to finish
                self._idle[conn] = min(self._idle[conn], time.monotonic() + self.io_timeout_s)
            self._heads[conn] = data
            return
        self._idle.pop(conn, None)
        self._heads.pop(conn, None)
        self._sel.unregister(conn)
        with self._busy_lock:
            self._busy += 1
        try:
            self._pool.submit(self._serve, conn, data)
        except RuntimeError:  # pool shut down
            self._served(conn)

    def _accept(self) -> None:
        for _ in range(64):
            try:
                conn, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:
                if e.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    # the pending connection stays queued and the listener readable: polling it
                    # now would spin, so leave it until some descriptors may have been closed
                    self._sel.unregister(self._listener)
                    self._accept_paused_until = time.monotonic() + ACCEPT_PAUSE_S
                    return
                continue  # ECONNABORTED and the like: that one connection is gone
            if len(self._idle) + self._busy >= self.max_connections:
                if not self._idle:  # every slot is a request being served: refuse this one
                    conn.close()
                    self.refused += 1
                    continue
                self._drop(next(iter(self._idle)))  # make room: the oldest idle one goes
                self.closed_idle += 1
            conn.setblocking(False)
            self._idle[conn] = time.monotonic() + self.idle_timeout_s
            self._sel.register(conn, selectors.EVENT_READ)

    def _serve(self, conn: socket.socket, data: bytes) -> None:
        """Answers the complete request head `data` (read by the selector thread)."""
        from prometheus_client.exposition import choose_encoder

        try:
            deadline = time.monotonic() + self.io_timeout_s
            head = data.split(b"\n", 1)[0].decode("latin-1").split()
            headers = {}
            for line in data.decode("latin-1").split("\n")[1:]:
                k, sep, v = line.partition(":")
                if sep:
                    headers[k.strip().lower()] = v.strip()
            if len(head) < 2 or head[0] not in ("GET", "HEAD"):
                self._respond(conn, deadline, "405 Method Not Allowed", "text/plain", b"only GET /metrics\n")
                return
            path = head[1].split("?", 1)[0]
            if path not in ("/", "/metrics"):
                self._respond(conn, deadline, "404 Not Found", "text/plain", b"see /metrics\n")
                return
            encoder, content_type = choose_encoder(headers.get("accept", ""))
            try:
                body = encoder(self.registry)
            except Exception:  # noqa: BLE001 — a collector bug: logged, 500 to the scraper
                log.exception("metrics collection failed")
                self._respond(conn, deadline, "500 Internal Server Error", "text/plain", b"collection failed\n")
                return
            self._respond(conn, deadline, "200 OK", content_type, b"" if head[0] == "HEAD" else body)
        except OSError:
            pass
        finally:
            self._served(conn)

    def _served(self, conn: socket.socket) -> None:
        conn.close()
        with self._busy_lock:
            self._busy -= 1

    @staticmethod
    def _respond(conn: socket.socket, deadline: float, status: str, ctype: str, body: bytes) -> None:
        conn.settimeout(max(0.1, deadline - time.monotonic()))
        head = (f"HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {len(body)}\r\n"
                "Connection: close\r\n\r\n").encode()
        conn.sendall(head + body)

    def shutdown(self) -> None:
        self._stopping = True
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass
        self._thread.join(timeout=5)
        self._pool.shutdown(wait=False, cancel_futures=True)
        for s in (self._listener, self._wake_r, self._wake_w):
            s.close()
        self._sel.close()
