"""stacklensd: the node daemon. gRPC on a Unix socket (+ optional TCP with TLS), Prometheus on HTTP.

Requires root or CAP_BPF + CAP_PERFMON + CAP_SYS_PTRACE (+ CAP_DAC_READ_SEARCH for /proc of other
users). The socket directory is root-owned 0750 with group `stacklens` when that group exists; the
socket is 0660 and every call needs the token in `token` beside it (0640).
"""

from __future__ import annotations

import argparse
import grp
import logging
import os
import secrets
import signal
import sys
import threading
import tomllib
from concurrent import futures
from pathlib import Path

import grpc

from stacklens import __version__
from stacklens.daemon import stacklens_pb2_grpc as pbg
from stacklens.daemon.core import AutoAttachRule, Daemon
from stacklens.daemon.grpc_service import StacklensServicer, TokenInterceptor
from stacklens.errors import EXIT_USAGE, InputError, StacklensError

log = logging.getLogger("stacklensd")
DEFAULT_SOCKET = "/run/stacklens/stacklens.sock"
DEFAULT_METRICS = "127.0.0.1:9780"
TOKEN_NAME = "token"


def _group_id(name: str = "stacklens") -> int | None:
    try:
        return grp.getgrnam(name).gr_gid
    except KeyError:
        return None


def prepare_socket_dir(sock: Path) -> Path:
    """Create the socket's directory (0750) and a fresh token file (0640); returns the token path."""
    d = sock.parent
    d.mkdir(parents=True, exist_ok=True)
    gid = _group_id()
    os.chmod(d, 0o750)
    if gid is not None and os.geteuid() == 0:
        os.chown(d, 0, gid)
    if sock.exists() or sock.is_symlink():
        sock.unlink()
    token_path = d / TOKEN_NAME
    tmp = d / f".{TOKEN_NAME}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o640)
    with os.fdopen(fd, "w") as fh:
        fh.write(secrets.token_hex(32))
    if gid is not None and os.geteuid() == 0:
        os.chown(tmp, 0, gid)
    os.replace(tmp, token_path)
    return token_path


def load_config(path: str | None) -> dict:
    if not path:
        return {}
    try:
        with open(path, "rb") as fh:
            return tomllib.load(fh)
    except FileNotFoundError:
        raise InputError(f"config file {path} not found") from None
    except tomllib.TOMLDecodeError as e:
        raise InputError(f"config file {path} is not valid TOML: {e}") from None


class StacklensDaemon:
    def __init__(
        self,
        *,
        socket_path: str = DEFAULT_SOCKET,
        metrics_address: str | None = DEFAULT_METRICS,
        tcp_address: str | None = None,
        tls_cert: str | None = None,
        tls_key: str | None = None,
        auto_attach: str | None = None,
        daemon: Daemon | None = None,
        top_k: int = 10,
    ) -> None:
        self.daemon = daemon or Daemon(auto_attach=AutoAttachRule(auto_attach) if auto_attach else None)
        self.socket_path = Path(socket_path)
        self.metrics_address = metrics_address
        self.tcp_address = tcp_address
        self.tls = (tls_cert, tls_key)
        self.top_k = top_k
        self._stop = threading.Event()
        self.server: grpc.Server | None = None
        self.http = None

    def _advisor(self):
        try:
            from stacklens.analyzer import analyze
        except ImportError:
            return None
        return analyze

    def start(self) -> None:
        token_path = prepare_socket_dir(self.socket_path)
        token = token_path.read_text().strip()
        self.server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=16, thread_name_prefix="grpc"),
            interceptors=[TokenInterceptor(token)],
            options=[("grpc.max_receive_message_length", 1 << 20), ("grpc.max_send_message_length", 256 << 20)],
        )
        pbg.add_StacklensServicer_to_server(StacklensServicer(self.daemon, self._advisor()), self.server)
        old = os.umask(0o117)  # socket created 0660
        try:
            self.server.add_insecure_port(f"unix:{self.socket_path}")
        finally:
            os.umask(old)
        gid = _group_id()
        if gid is not None and os.geteuid() == 0:
            os.chown(self.socket_path, 0, gid)
        if self.tcp_address:
            cert, key = self.tls
            if not (cert and key):
                raise InputError("a TCP listener needs TLS: give --tls-cert and --tls-key")
            creds = grpc.ssl_server_credentials([(Path(key).read_bytes(), Path(cert).read_bytes())])
            self.server.add_secure_port(self.tcp_address, creds)
        self.server.start()
        if self.metrics_address:
            self._start_metrics()
        threading.Thread(target=self._housekeeping, name="stacklens-housekeeping", daemon=True).start()
        log.info("stacklensd %s listening on unix:%s", __version__, self.socket_path)

    def _start_metrics(self) -> None:
        from prometheus_client import CollectorRegistry, start_http_server

        from stacklens.daemon.prom import StacklensCollector

        host, _, port = self.metrics_address.rpartition(":")
        registry = CollectorRegistry()
        registry.register(
            StacklensCollector(self._prom_sources, health=self._health, top_k=self.top_k, findings=self._finding_counts)
        )
        self.http, _ = start_http_server(int(port), addr=host or "127.0.0.1", registry=registry)

    def _prom_sources(self):
        for s in self.daemon.active():
            try:
                yield s.pid, s.comm, "", s.snapshot(), s.stats()
            except StacklensError:
                continue

    def _finding_counts(self, pid, snap) -> dict[str, int]:
        adv = self._advisor()
        if adv is None:
            return {}
        counts: dict[str, int] = {}
        for f in adv(snap):
            counts[f.rule] = counts.get(f.rule, 0) + 1
        return counts

    def _health(self) -> dict[str, int]:
        out = {"events": 0, "drops": 0, "unwind_errors": 0}
        for s in self.daemon.active():
            try:
                st = s.stats()
            except StacklensError:
                continue
            out["events"] += st.get("events", 0)
            out["drops"] += sum(v for k, v in st.items() if "drop" in k or "lost" in k)
            out["unwind_errors"] += sum(v for k, v in st.items() if "unwind" in k)
        return out

    def _housekeeping(self) -> None:
        while not self._stop.wait(2.0):
            try:
                self.daemon.auto_attach_scan()
            except Exception:  # noqa: BLE001
                log.exception("auto-attach scan failed")

    def stop(self) -> None:
        self._stop.set()
        self.daemon.shutdown()
        if self.server:
            self.server.stop(grace=1).wait()
        if self.http:
            self.http.shutdown()
        try:
            self.socket_path.unlink()
        except FileNotFoundError:
            pass


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="stacklensd", description="stacklens node daemon")
    p.add_argument("--version", action="version", version=f"stacklensd {__version__}")
    p.add_argument("--socket", default=None, help=f"Unix socket (default {DEFAULT_SOCKET})")
    p.add_argument("--metrics-address", default=None, help=f"Prometheus HOST:PORT (default {DEFAULT_METRICS}; 'off' disables)")
    p.add_argument("--config", help="TOML config: socket, metrics_address, tcp_address, tls_cert, tls_key, auto_attach, top_k")
    p.add_argument("--tcp-address", help="optional gRPC TCP listener (TLS required)")
    p.add_argument("--tls-cert")
    p.add_argument("--tls-key")
    p.add_argument("--auto-attach", help="regex on comm: attach probes (never the agent) to matching GPU processes")
    p.add_argument("--log-level", default="INFO")
    return p


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:
        return 0 if e.code in (0, None) else EXIT_USAGE
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        cfg = load_config(args.config)
        metrics = args.metrics_address or cfg.get("metrics_address", DEFAULT_METRICS)
        d = StacklensDaemon(
            socket_path=args.socket or cfg.get("socket", DEFAULT_SOCKET),
            metrics_address=None if metrics == "off" else metrics,
            tcp_address=args.tcp_address or cfg.get("tcp_address"),
            tls_cert=args.tls_cert or cfg.get("tls_cert"),
            tls_key=args.tls_key or cfg.get("tls_key"),
            auto_attach=args.auto_attach or cfg.get("auto_attach"),
            top_k=int(cfg.get("top_k", 10)),
        )
        d.start()
    except StacklensError as e:
        print(f"stacklensd: error: {e}", file=sys.stderr)
        return e.exit_code
    except OSError as e:
        print(f"stacklensd: error: {e}", file=sys.stderr)
        return 1
    done = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: done.set())
    print(f"stacklensd: ready on unix:{d.socket_path}", flush=True)
    done.wait()
    d.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
