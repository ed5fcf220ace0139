"""Prometheus exposition: a pull collector over session snapshots (never touched by the hot path).

Names: `stacklens_` prefix, `_total` counters, `_seconds`, `_bytes`; one family per metric of the
registry (cct/metrics.py: name, HELP, unit), so a new metric is exported without an edit here.
Process labels `pid`, `comm`, `container`. Hotspots are the top-K contexts per process under a
short bounded `context` label plus `[other]`; never a raw kernel name or a whole stack. A cap on
hotspot series, with a counter of evictions. No privilege beyond the daemon's.

The daemon's TCP endpoint is readable by every local user, so hotspot series (file:function:line
of other users' processes) are exported only when asked for (`hotspots=True`; stacklensd
`--metrics-hotspots` / `metrics_hotspots = true`); totals per process are always there.

`MetricsServer` serves the scrape without a thread per connection (prometheus_client's
`start_http_server` spawns one per connection, with no timeout: 300 idle connections from any user
gave the root daemon 96 threads). One selector thread holds up to MAX_CONNECTIONS open connections
(the oldest idle one is closed to admit a new one; an idle one is closed after IDLE_TIMEOUT_S),
reads each request head itself without blocking (up to MAX_REQUEST_BYTES, within IO_TIMEOUT_S of its
first byte) and hands only complete requests to a pool of WORKERS threads, so a client that sends a
byte and stalls holds a slot, never a worker. When the process is out of file descriptors the
listener is left alone for ACCEPT_PAUSE_S rather than polled in a spin. Threads: 1 + WORKERS,
whatever clients do.
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
from typing import Callable, Iterable

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from stacklens.cct import Frame, Snapshot, metrics

log = logging.getLogger(__name__)

# metric → (exported name stem, scale to base unit, help), from the registry (cct/metrics.py)
PROCESS_METRICS = {m.name: (m.prom, metrics.base_unit_scale(m.name), m.help) for m in metrics.REGISTRY}
HOTSPOT_METRICS = metrics.HOTSPOT
CONTEXT_LABEL_MAX = 120


def context_label(path: tuple[Frame, ...]) -> str:
    """A short, bounded name for a context: innermost Python line, innermost op, and the leaf."""
    py = next((f for f in reversed(path) if f.kind == "python"), None)
    op = next((f for f in reversed(path) if f.kind == "op"), None)
    parts = []
    if py is not None:
        parts.append(f"{py.file.rsplit('/', 1)[-1]}:{py.name}:{py.line}")
    if op is not None:
        parts.append(op.name)
    if path and path[-1] not in (py, op):
        leaf = path[-1]
        parts.append(leaf.label() if leaf.kind != "kernel" else "kernel:" + leaf.name[:40])
    label = " > ".join(parts) or "[root]"
    return label if len(label) <= CONTEXT_LABEL_MAX else label[: CONTEXT_LABEL_MAX - 1] + "…"


def hotspots(snap: Snapshot, metric: str, k: int) -> list[tuple[str, int]]:
    """Top-k contexts by exclusive `metric` (summed per short label) plus `[other]` for the rest."""
    by_label: collections.Counter[str] = collections.Counter()
    for path, values in snap.iter_paths():
        v = values.get(metric, 0)
        if v:
            by_label[context_label(path)] += v
    top = by_label.most_common(k)
    rest = sum(by_label.values()) - sum(v for _, v in top)
    if rest:
        top.append(("[other]", rest))
    return top


class StacklensCollector(Collector):
    """Reads `sources()` → [(pid, comm, container, snapshot, stats)] at scrape time."""

    def __init__(
        self,
        sources: Callable[[], Iterable[tuple[int, str, str, Snapshot, dict[str, int]]]],
        *,
        health: Callable[[], dict[str, int]] = dict,
        top_k: int = 10,
        series_cap: int = 5_000,
        findings: Callable[[int, Snapshot], dict[str, int]] | None = None,
        hotspots: bool = False,
    ) -> None:
        self.sources = sources
        self.hotspots_on = hotspots
        self.health = health
        self.top_k = top_k
        self.series_cap = series_cap
        self.findings = findings
        self.series_evicted = 0

    def describe(self):  # no describe-time scrape (prometheus_client calls collect otherwise)
        return []

    def collect(self):
        labels = ["pid", "comm", "container"]
        fams = {
            m: CounterMetricFamily(f"stacklens_{stem}", help_, labels=labels)
            for m, (stem, _, help_) in PROCESS_METRICS.items()
        }
        hot = {
            m: CounterMetricFamily(
                f"stacklens_hotspot_{PROCESS_METRICS[m][0]}",
                f"top-{self.top_k} contexts by exclusive {m}; [other] holds the rest",
                labels=labels + ["context"],
            )
            for m in HOTSPOT_METRICS
        }
        drops = CounterMetricFamily("stacklens_process_dropped_events", "events dropped for this process", labels=labels)
        unavailable = GaugeMetricFamily(
            "stacklens_metric_unavailable", "1 when a metric is not measured for this process", labels=labels + ["metric"]
        )
        finding_fam = GaugeMetricFamily("stacklens_findings", "analyzer findings by rule", labels=labels + ["rule"])
        budget = self.series_cap
        attached = 0
        for pid, comm, container, snap, stats in self.sources():
            attached += 1
            lv = [str(pid), comm, container]
            for m, (_, scale, _) in PROCESS_METRICS.items():
                if m in snap.metrics and m not in snap.unavailable:
                    fams[m].add_metric(lv, snap.total(m) * scale)
            for m in sorted(snap.unavailable):
                unavailable.add_metric(lv + [m], 1)
            drops.add_metric(lv, sum(v for k, v in stats.items() if "drop" in k or "lost" in k))
            for m in HOTSPOT_METRICS if self.hotspots_on else ():
                if m not in snap.metrics or m in snap.unavailable:
                    continue
                scale = PROCESS_METRICS[m][1]
                for label, v in hotspots(snap, m, self.top_k):
                    if budget <= 0:
                        self.series_evicted += 1
                        continue
                    budget -= 1
                    hot[m].add_metric(lv + [label], v * scale)
            if self.findings is not None:
                try:
                    for rule, n in self.findings(pid, snap).items():
                        finding_fam.add_metric(lv + [rule], n)
                except Exception:  # noqa: BLE001 — a rule bug must not break the scrape
                    log.exception("analyzer failed during scrape")
        yield from fams.values()
        if self.hotspots_on:
            yield from hot.values()
        yield drops
        yield unavailable
        yield finding_fam
        yield GaugeMetricFamily("stacklens_attached_processes", "processes attached", value=attached)
        h = self.health()
        for key in ("events", "drops", "unwind_errors"):
            yield CounterMetricFamily(f"stacklens_{key}", f"daemon-wide {key.replace('_', ' ')}", value=h.get(key, 0))
        yield CounterMetricFamily(
            "stacklens_series_evicted", "hotspot series not exported because of the series cap", value=self.series_evicted
        )


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
