"""stacklensd: the node daemon. gRPC on a Unix socket (+ optional TCP with TLS), Prometheus on HTTP.

Requires root or CAP_BPF + CAP_PERFMON + CAP_SYS_PTRACE (+ CAP_DAC_READ_SEARCH for /proc of other
users). The socket is 0660 (group `stacklens` when that group exists) and every call but the health
check needs the token in a 0640 `token` file (see `prepare_socket_dir`).

Socket directory: the daemon never changes the mode or owner of a directory it did not create
(`--socket /tmp/x.sock` once turned /tmp into 0750 for every user; issue 17).
- The socket's directory does not exist (e.g. /run/stacklens outside systemd): the daemon creates
  it 0750 root:stacklens and keeps the token there.
- It exists and is private to us (owned by our euid, not group/world-writable: the unit's
  RuntimeDirectory, a directory from an earlier run): token there, the directory is left as it is.
- It exists and is someone else's or shared (a sticky 1777 /tmp, a user's home): the token goes into
  a fresh daemon-owned `SOCKNAME.d/` beside the socket (0750 root:stacklens; reused only when it is
  a real directory of ours that nobody else can write). A group/world-writable directory without
  the sticky bit is refused: anyone could rename the socket or that subdirectory away.
A stale socket of ours at the path is replaced; anything else there is refused. Clients look for
`SOCKNAME.d/token`, then `token` beside the socket (`client.token_candidates`). At stop the daemon
removes the socket and the token file it wrote, not the directories. At start it replaces a
killed daemon's socket and token, and removes the agent files (lock, socket, code and bootstrap
token per target) it left (`inject.channel.agentdir.clean_stale_files`).

Standard gRPC services (`grpc_service.add_standard_services`): grpc.health.v1.Health (SERVING;
NOT_SERVING once stopping), the one service that needs no token, for kubelet's gRPC probe and
`grpc_health_probe -addr unix:///run/stacklens/stacklens.sock`; server reflection v1 and v1alpha,
token-gated like the rest, e.g.
`grpcurl -plaintext -unix -H "authorization: Bearer $(cat /run/stacklens/token)" /run/stacklens/stacklens.sock list`.

Metrics: `MetricsServer` (daemon/metrics_http.py), bounded threads and connections; hotspot
series only with `--metrics-hotspots`. Shutdown (SIGTERM/SIGINT) ends streams at once, gives RPCs
1 s, detaches every session and exits within a few seconds whatever clients do (RPC threads still
busy, e.g. inside a BCC compile, do not hold the exit).
"""

from __future__ import annotations

import argparse
import grp
import logging
import os
import secrets
import signal
import stat
import sys
import threading
from concurrent import futures
from pathlib import Path

import grpc

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the same parser as the `tomli` package (a dependency there)
    import tomli as tomllib  # type: ignore[no-redef]

from stacklens import __version__
from stacklens.daemon import grpc_service
from stacklens.daemon import stacklens_pb2_grpc as pbg
from stacklens.daemon.client import TOKEN_NAME, token_subdir
from stacklens.daemon.core import AutoAttachRule, Daemon
from stacklens.daemon.grpc_service import StacklensServicer, TokenInterceptor
from stacklens.daemon.session import default_probe_prepare
from stacklens.errors import EXIT_USAGE, InputError, StacklensError

log = logging.getLogger("stacklensd")
DEFAULT_SOCKET = "/run/stacklens/stacklens.sock"
DEFAULT_METRICS = "127.0.0.1:9780"


def _group_id(name: str = "stacklens") -> int | None:
    try:
        return grp.getgrnam(name).gr_gid
    except KeyError:
        return None


def _private(st: os.stat_result) -> bool:
    """A directory only we can change: ours, not writable by group or others."""
    return stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid() and not st.st_mode & 0o022


def _own_dir(fd: int) -> None:
    """Mode and owner of a directory the daemon created (and only such a one)."""
    os.fchmod(fd, 0o750)
    gid = _group_id()
    if gid is not None and os.geteuid() == 0:
        os.fchown(fd, 0, gid)


def _open_dir(path: Path) -> int:
    return os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)


def _token_dir(sock: Path) -> tuple[int, Path]:
    """(open fd, path) of the directory that gets the token; see the module docstring."""
    d = sock.parent
    d.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.mkdir(d, 0o750)
        fd = _open_dir(d)
        _own_dir(fd)
        return fd, d
    except FileExistsError:
        pass
    st = os.stat(d)
    if not stat.S_ISDIR(st.st_mode):
        raise InputError(f"{d} is not a directory: pass another --socket")
    if _private(st):
        return _open_dir(d), d
    if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
        raise InputError(f"{d} is writable by other users and not sticky: anyone could replace the socket "
                         "there; put --socket in a directory of its own (e.g. /run/stacklens/)")
    sub = d / token_subdir(sock)
    try:
        os.mkdir(sub, 0o750)
        fd = _open_dir(sub)
        _own_dir(fd)
        return fd, sub
    except FileExistsError:
        pass
    try:
        fd = _open_dir(sub)
    except OSError:
        raise InputError(f"{sub} exists and is not a directory of stacklensd's: remove it or pass another "
                         "--socket") from None
    if not _private(os.fstat(fd)):
        os.close(fd)
        raise InputError(f"{sub} exists but is not stacklensd's own (owner or mode): remove it or pass "
                         "another --socket")
    return fd, sub


def _clear_socket(sock: Path) -> None:
    """Removes a stale socket of ours at `sock`; refuses anything else there."""
    try:
        st = os.lstat(sock)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode) or st.st_uid != os.geteuid():
        raise InputError(f"{sock} exists and is not a stacklensd socket: remove it or pass another --socket")
    sock.unlink()


def prepare_socket_dir(sock: Path) -> Path:
    """Picks (or creates) the token's directory, clears a stale socket, writes a fresh token file
    (0640); returns the token's path. Changes no directory it did not create."""
    fd, d = _token_dir(sock)
    try:
        _clear_socket(sock)
        gid = _group_id()
        tmp = f".{TOKEN_NAME}.tmp"
        try:
            os.unlink(tmp, dir_fd=fd)
        except FileNotFoundError:
            pass
        tfd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o640, dir_fd=fd)
        with os.fdopen(tfd, "w") as fh:
            os.fchmod(fh.fileno(), 0o640)
            if gid is not None and os.geteuid() == 0:
                os.fchown(fh.fileno(), 0, gid)
            fh.write(secrets.token_hex(32))
        os.replace(tmp, TOKEN_NAME, src_dir_fd=fd, dst_dir_fd=fd)
    finally:
        os.close(fd)
    return d / TOKEN_NAME


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


STOP_WATCHDOG_S = 30.0    # SIGTERM to exit: a stop takes ~1 s (RPCs get 1 s; each session detached in well under 1 s)
WARM_UP_EVERY_S = 10.0   # between looks for processes to compile ahead for (Daemon.warm_up)


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
        top_k: int = 30,
        metrics_hotspots: bool = False,
        warm_up: bool = False,
    ) -> None:
        """``warm_up``: compile at start the BPF programs the torch/JAX processes running then
        would need (`Daemon.warm_up`), in the background; stacklensd turns it on."""
        self.daemon = daemon or Daemon(auto_attach=AutoAttachRule(auto_attach) if auto_attach else None,
                                       prepare=default_probe_prepare if warm_up else None)
        self.socket_path = Path(socket_path)
        self.metrics_address = metrics_address
        self.metrics_hotspots = metrics_hotspots
        self.tcp_address = tcp_address
        self.tls = (tls_cert, tls_key)
        self.top_k = top_k
        self._stop = threading.Event()
        self.server: grpc.Server | None = None
        self.servicer: StacklensServicer | None = None
        self.health = None  # grpc_health's HealthServicer once started
        self._executor: futures.ThreadPoolExecutor | None = None
        self.token_path: Path | None = None
        self.http = None
        self._warm_thread: threading.Thread | None = None

    def _advisor(self):
        try:
            from stacklens.analyzer import analyze
        except ImportError:
            return None
        return analyze

    def start(self) -> None:
        grpc_service.install_log_filters()
        self.token_path = prepare_socket_dir(self.socket_path)
        self._clean_agent_leftovers()
        token = self.token_path.read_text().strip()
        self._executor = futures.ThreadPoolExecutor(max_workers=grpc_service.WORKERS, thread_name_prefix="grpc")
        self.server = grpc.server(
            self._executor,
            interceptors=[TokenInterceptor(token)],
            options=[("grpc.max_receive_message_length", 1 << 20), ("grpc.max_send_message_length", 256 << 20)],
        )
        self.servicer = StacklensServicer(self.daemon, self._advisor())
        pbg.add_StacklensServicer_to_server(self.servicer, self.server)
        self.health = grpc_service.add_standard_services(self.server)
        old = os.umask(0o117)  # socket created 0660
        try:
            self.server.add_insecure_port(f"unix:{self.socket_path}")
        finally:
            os.umask(old)
        gid = _group_id()
        if gid is not None and os.geteuid() == 0:
            os.chown(self.socket_path, 0, gid, follow_symlinks=False)
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
        self._warm_thread = threading.Thread(target=self._warm_up, name="stacklens-warm-up", daemon=True)
        self._warm_thread.start()
        log.info("stacklensd %s listening on unix:%s (token %s)", __version__, self.socket_path, self.token_path)

    def _clean_agent_leftovers(self) -> None:
        """Agent files (lock, socket, code with its bootstrap token) that a killed daemon left,
        removed now rather than at some later attach; live servers' files, of any daemon, stay."""
        from stacklens.inject.channel.agentdir import clean_stale_files

        try:
            n = clean_stale_files(getattr(self.daemon, "procfs", None))
        except OSError as e:
            log.warning("could not sweep the agent directories for a killed daemon's files: %s", e)
            return
        if n:
            log.info("removed the agent files of %d process(es) that a stopped daemon left behind", n)

    def _start_metrics(self) -> None:
        from stacklens.daemon.metrics_http import MetricsServer
        from stacklens.daemon.prom import StacklensCollector, build_registry

        host, _, port = self.metrics_address.rpartition(":")
        registry = build_registry(
            StacklensCollector(self._prom_sources, health=self.daemon.node_stats, top_k=self.top_k,
                               findings=self._finding_counts, hotspots=self.metrics_hotspots),
            procfs=self.daemon.procfs,
        )
        try:
            self.http = MetricsServer(registry, host.strip("[]") or "127.0.0.1", int(port)).start()
        except ValueError:
            raise InputError(f"metrics address {self.metrics_address!r} is not HOST:PORT") from None
    def _prom_sources(self):
        from stacklens.daemon.prom import Source

        for s in self.daemon.active():
            try:
                est = self.daemon.overheads.of(s)
                yield Source(s.pid, s.comm, "", s.snapshot(), s.stats(), cpu_hz=s.cpu_hz, agent_connected=_agent_up(s),
                             rank=getattr(s, "rank", None), probe_overhead=est.share if est is not None else None)
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

    def _warm_up(self) -> None:
        """Its own thread: a compile takes seconds, the housekeeping must not wait for it."""
        while True:
            try:
                n = self.daemon.warm_up()
            except Exception:  # noqa: BLE001 — an attach compiles what the warm-up could not
                log.exception("BPF warm-up failed")
            else:
                if n:
                    log.info("BPF programs prepared for %d CPython build(s) of running torch/JAX processes", n)
            if self.daemon.warm_up_done() or self._stop.wait(WARM_UP_EVERY_S):
                return

    def compiling(self) -> bool:
        """Whether the warm-up is inside a BCC compile (seconds; it cannot be interrupted)."""
        if self._warm_thread is None:
            return False
        self._warm_thread.join(0.2)   # after stop(), a warm-up between two compiles ends at once
        return self._warm_thread.is_alive()

    def _housekeeping(self) -> None:
        while not self._stop.wait(2.0):
            try:
                self.daemon.auto_attach_scan()
            except Exception:  # noqa: BLE001
                log.exception("auto-attach scan failed")
            self.daemon.tidy()

    def stop(self) -> None:
        """Ends streams now, RPCs within ~1 s, then every session; never waits on a client."""
        self._stop.set()
        if self.health is not None:
            self.health.enter_graceful_shutdown()  # Watch streams see NOT_SERVING before they end
        if self.servicer is not None:
            self.servicer.close()
        self.daemon.close()  # attaches in flight stop their session when they finish
        if self.server:
            self.server.stop(grace=1).wait(3)
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
        if self.http:
            self.http.shutdown()
        self.daemon.shutdown()
        for path in (self.socket_path, self.token_path):
            try:
                if path is not None:
                    path.unlink()
            except FileNotFoundError:
                pass


def _agent_up(s) -> bool | None:
    """None: no agent asked for (or one that cannot tell); else whether its channel is up."""
    if not s.want_agent:
        return None
    if s.agent is None:
        return False
    connected = getattr(s.agent, "connected", None)
    return None if connected is None else bool(connected())


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="stacklensd", description="stacklens node daemon")
    p.add_argument("--version", action="version", version=f"stacklensd {__version__}")
    p.add_argument("--socket", default=None, help=f"Unix socket (default {DEFAULT_SOCKET})")
    p.add_argument("--metrics-address", default=None, help=f"Prometheus HOST:PORT (default {DEFAULT_METRICS}; 'off' disables)")
    p.add_argument("--metrics-hotspots", action="store_true", default=None,
                   help="also export hotspot series (file:function:line of profiled processes) on the metrics "
                        "endpoint, which every local user can read; off by default")
    p.add_argument("--config", help="TOML config: socket, metrics_address, metrics_hotspots, tcp_address, tls_cert, "
                                    "tls_key, auto_attach, top_k")
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
            top_k=int(cfg.get("top_k", 30)),
            metrics_hotspots=bool(args.metrics_hotspots if args.metrics_hotspots is not None
                                  else cfg.get("metrics_hotspots", False)),
            warm_up=bool(cfg.get("warm_up", True)),
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
    # Python runs handlers on the main thread, but the kernel may hand SIGTERM to any thread (CI
    # saw it go to another while the warm-up compiled); a main thread blocked in an untimed wait
    # is then never woken and the daemon hangs. A timed wait returns to the interpreter, which
    # runs the pending handler.
    while not done.wait(0.5):
        pass
    # a stop that hangs is a bug to see, not to wait for: its threads' stacks go to the log
    watchdog = threading.Timer(STOP_WATCHDOG_S, _stuck_stop)
    watchdog.daemon = True
    watchdog.start()
    d.stop()
    busy = [t.name for t in threading.enumerate() if not t.daemon and t is not threading.main_thread()]
    if d.compiling():
        busy.append("the BPF warm-up")
    if busy:
        log.info("exiting with %d thread(s) still busy: %s", len(busy), ", ".join(busy[:4]))
    # Every session is detached and the sockets are gone: nothing is left for the interpreter's
    # finalization to do but wait — for RPC threads inside an attach, for a BCC compile of the
    # warm-up (BCC's exit hooks take its lock), for exit hooks of programs compiled ahead (CI saw
    # a daemon take over 10 s to exit after its warm-up had compiled one). The kernel frees what
    # the process holds.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _stuck_stop() -> None:
    log.error("stopping took over %.0f s; exiting anyway. Threads:", STOP_WATCHDOG_S)
    import faulthandler

    faulthandler.dump_traceback(all_threads=True)
    logging.shutdown()
    os._exit(1)


if __name__ == "__main__":
    sys.exit(main())
