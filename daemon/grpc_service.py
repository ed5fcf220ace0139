"""The gRPC service over a `Daemon`: request validation and error → status mapping in one place.

Authorization: the Unix socket is mode 0660 (root + group `stacklens`); every call must also carry
the daemon's token (`authorization: Bearer …`, read from the root:stacklens 0640 token file beside
the socket), so a connection that gets past the file mode — or a TCP client — still needs it.

Standard services beside stacklens.v1.Stacklens (`add_standard_services`): grpc.health.v1.Health
(SERVING for "" and the stacklens service; NOT_SERVING from the start of a stop), whose Check and
Watch need no token (`OPEN_METHODS`: kubelet's gRPC probe cannot send one), and server reflection,
grpc.reflection.v1 (grpcurl, newer clients) and v1alpha (grpc_cli, older ones), behind the token:
it shows only the published schema, but its streams hold workers that a client without the token
should not be able to take.

Workers: unary calls must never wait behind long-lived calls, so `StreamSnapshots` is capped at
MAX_STREAMS concurrent streams, Attach and WaitAttach calls that wait at MAX_ATTACHES and
reflection at MAX_REFLECTION streams (RESOURCE_EXHAUSTED beyond, with what to do); health Watch
streams hold no worker (grpc's non-blocking handler; at most MAX_WATCHES). The server has WORKERS
threads, so at least WORKERS - MAX_STREAMS - MAX_ATTACHES - MAX_REFLECTION are always free for the
rest. An attach itself runs on a thread of the daemon's (attachop.AttachOp), not on a worker: a
client waits for it at most MAX_ATTACH_WAIT_S per call and follows it with WaitAttach. A stream waits
between snapshots on an Event that its cancellation (`context.add_callback`) and `close()` (daemon
stop) set, so it gives its worker back at once.
Errors: StacklensError → its status code; anything else → INTERNAL with a short message naming
the RPC (the exception text stays in the daemon's log, logged once with its traceback).
Requests that do not decode are logged as one rate-limited line (`install_log_filters`).
"""

from __future__ import annotations

import functools
import hmac
import inspect
import logging
import math
import threading
import time

import grpc

from stacklens import __version__
from stacklens.cct import CCT, Frame, Snapshot, diff
from stacklens.cct.export import encode_profile
from stacklens.daemon import stacklens_pb2 as pb
from stacklens.daemon import stacklens_pb2_grpc as pbg
from stacklens.daemon.attachop import ATTACHING, AttachOp
from stacklens.daemon.core import Daemon
from stacklens.daemon.pslist import list_processes, process_row
from stacklens.introspect.ranks import ProcRankHost, find_job
from stacklens.daemon.windows import WindowSpec, end_window, window_steps
from stacklens.errors import DaemonUnavailable, InputError, NoSuchProcess, StacklensError
from stacklens.introspect.procfs import check_pid_range

log = logging.getLogger(__name__)

MAX_WINDOW_S = 60.0  # window + diff window must fit the 120 s horizon of the tree
MAX_INTERVAL_MS = 60_000  # a stream's interval; longer than the largest window is pointless
MIN_INTERVAL_MS = 100
WORKERS = 32
MAX_STREAMS = 8
MAX_ATTACHES = 16
MAX_WINDOWS = 8     # profile windows at once (each holds a worker for its length)
MAX_REFLECTION = 2  # a reflection client holds its stream (and a worker) while it asks
MAX_WATCHES = 64    # health Watch streams (open without the token; they hold no worker)
# Health/Check and Health/Watch need no token: kubelet's gRPC probe and grpc_health_probe cannot
# send one, and the answer (SERVING or not) reveals nothing. Exact paths: grpc matches them so.
OPEN_METHODS = frozenset({"/grpc.health.v1.Health/Check", "/grpc.health.v1.Health/Watch"})
REFLECTION_V1 = "grpc.reflection.v1.ServerReflection"
MAX_ATTACH_WAIT_S = 30.0   # one Attach/WaitAttach call waits at most this long for progress
DEFAULT_ATTACH_WAIT_S = 10.0


class Busy(StacklensError):
    """Too many long-lived calls of one kind at once."""

    grpc_code = "RESOURCE_EXHAUSTED"


def _abort(context: grpc.ServicerContext, err: StacklensError):
    context.abort(getattr(grpc.StatusCode, err.grpc_code, grpc.StatusCode.INTERNAL), str(err))


def _internal(context: grpc.ServicerContext, name: str, e: Exception):
    log.error("%s failed unexpectedly (%s)", name, type(e).__name__, exc_info=e)
    context.abort(grpc.StatusCode.INTERNAL, f"internal error in {name} ({type(e).__name__}); "
                  "see the stacklensd log and report it")


def _fail(context: grpc.ServicerContext, name: str, err: Exception) -> None:
    if isinstance(err, StacklensError):
        _abort(context, err)
    _internal(context, name, err)      # a bug: INTERNAL, logged once


def rpc(fn):
    """Maps what a handler raises to a status: StacklensError → its code, anything else → INTERNAL.
    Handlers never call context.abort themselves. (The status is set outside the `except`, so the
    abort does not chain the handler's exception.)"""
    name = fn.__name__
    if inspect.isgeneratorfunction(fn):
        @functools.wraps(fn)
        def stream(self, request, context):
            try:
                yield from fn(self, request, context)
                return
            except Exception as e:  # noqa: BLE001 — mapped by _fail
                err = e
            _fail(context, name, err)

        return stream

    @functools.wraps(fn)
    def unary(self, request, context):
        try:
            return fn(self, request, context)
        except Exception as e:  # noqa: BLE001 — mapped by _fail
            err = e
        _fail(context, name, err)

    return unary


class _Slots:
    """At most `n` holders at once; `take()` raises Busy(message) beyond."""

    def __init__(self, n: int, message: str) -> None:
        self.n, self.message, self.used = n, message, 0
        self._lock = threading.Lock()

    def take(self) -> None:
        with self._lock:
            if self.used >= self.n:
                raise Busy(self.message)
            self.used += 1

    def give(self) -> None:
        with self._lock:
            self.used -= 1


class _DecodeErrorFilter(logging.Filter):
    """grpc logs each request that fails to decode with a 5-line traceback: one line per
    `every_s` instead, with the number of others since."""

    def __init__(self, every_s: float = 60.0) -> None:
        super().__init__()
        self.every_s = every_s
        self._last = -math.inf
        self._skipped = 0
        self._lock = threading.Lock()

    def filter(self, record: logging.LogRecord) -> bool:
        if "deserializing" not in str(record.msg):
            return True
        with self._lock:
            now = time.monotonic()
            if now - self._last < self.every_s:
                self._skipped += 1
                return False
            self._last, skipped, self._skipped = now, self._skipped, 0
        record.msg = "malformed request: the protobuf message did not decode (INTERNAL returned)" + (
            f"; {skipped} more since the last report" if skipped else "")
        record.args = ()
        record.exc_info = None
        record.exc_text = None
        return True


_FILTER = _DecodeErrorFilter()


def install_log_filters() -> None:
    """Rate-limits grpc's log of undecodable requests (idempotent)."""
    for name in ("grpc._common", "grpc._server"):
        lg = logging.getLogger(name)
        if _FILTER not in lg.filters:
            lg.addFilter(_FILTER)


def _check_window(w: float, name: str = "window_s") -> float | None:
    if math.isnan(w) or w < 0 or w > MAX_WINDOW_S:
        raise InputError(f"{name} must be within 0..{MAX_WINDOW_S:g} seconds (0 = cumulative)")
    return w or None


def prune(snap: Snapshot, metric: str, depth: int, top_k: int) -> Snapshot:
    """`snap` limited to `depth` levels and the `top_k` children (by inclusive metric) per node.

    What is cut is charged to the nearest kept ancestor (to `[other]` at the top), so every
    inclusive value that is kept, and every total, stays exact.
    """
    if not depth and not top_k:
        return snap
    keep = {snap.root}
    stack = [(snap.root, 0)]
    while stack:
        node, d = stack.pop()
        if depth and d >= depth:
            continue
        kids = sorted(snap.children(node), key=lambda c: snap.inclusive(c, metric), reverse=True)
        for c in kids[: top_k or None]:
            keep.add(c)
            stack.append((c, d + 1))
    tree = CCT(metrics=snap.metrics, max_nodes=len(keep) + 2)
    other = (Frame.other("[other]"),)
    threaded = snap.threaded
    for n in range(snap.node_count):
        values = {m: snap.exclusive(n, m) for m in snap.metrics}
        if not any(values.values()):
            continue
        a = n
        while a not in keep:
            a = snap.parent(a)
        path = snap.path(a) or other
        for m in threaded:            # the breakdown by thread goes with the values
            for tid, count in snap.threads(n, m):
                tree.add_sample(path, m, tid, count)
                values[m] -= count
        tree.add_many(path, values)
    return tree.snapshot(meta=dict(snap.meta), unavailable=snap.unavailable)


class StacklensServicer(pbg.StacklensServicer):
    def __init__(self, daemon: Daemon, advisor=None) -> None:
        self.daemon = daemon
        self.advisor = advisor
        self.seq = 0
        self._streams = _Slots(MAX_STREAMS, f"at most {MAX_STREAMS} snapshot streams at once: close a "
                               "`stacklens top` or poll with GetSnapshot")
        self._attaches = _Slots(MAX_ATTACHES, f"at most {MAX_ATTACHES} attaches in flight: retry when one "
                                "has finished")
        self._windows = _Slots(MAX_WINDOWS, f"at most {MAX_WINDOWS} profile windows at once: retry when one "
                               "has ended, or profile with --no-daemon")
        self._waits: set[threading.Event] = set()
        self._lock = threading.Lock()
        self._closed = False

    def close(self) -> None:
        """Daemon stop: every stream ends now, new ones are refused."""
        with self._lock:
            self._closed = True
            waits = list(self._waits)
        for w in waits:
            w.set()

    def _snapshot_response(self, req: pb.SnapshotRequest) -> pb.SnapshotResponse:
        check_pid_range(req.pid)
        window = _check_window(req.window_s)
        dwin = _check_window(req.diff_window_s, "diff_window_s")
        if req.depth > 10_000 or req.top_k > 100_000:
            raise InputError("depth must be <= 10000 and top_k <= 100000")
        s = self.daemon.session(req.pid)
        snap = s.snapshot(window_s=window)
        if dwin:
            if not window:
                raise InputError("diff_window_s needs window_s (the newer window)")
            older = s.snapshot(window_s=window + dwin)
            snap = diff(snap, diff(older, snap))  # newer window minus the one right before it
        metric = req.metric or "cpu_samples"
        if metric not in snap.metrics:
            raise InputError(f"unknown metric {metric!r}; known: {', '.join(snap.metrics)}")
        profile = encode_profile(prune(snap, metric, req.depth, req.top_k))
        self.seq += 1
        return pb.SnapshotResponse(
            pid=req.pid,
            profile=profile,
            seq=self.seq,
            state=s.state,
            stats={k: max(0, int(v)) for k, v in s.stats().items()},
        )

    def _wait_attach(self, op: AttachOp, seen_step: int | None, wait_s: float | None) -> None:
        """Waits (holding an attach slot, at most `wait_s`) for the attach's end or, given
        `seen_step`, a step after it."""
        self._attaches.take()
        try:
            op.wait(seen_step, wait_s)
        finally:
            self._attaches.give()

    @staticmethod
    def _attach_response(op: AttachOp, joined: bool = False) -> pb.AttachResponse:
        """The attach's progress, or its notes once it ended well; its error (raised) if it failed."""
        phase, phase_s, elapsed_s = op.progress()
        if op.ended:
            return pb.AttachResponse(pid=op.pid, notes=op.result(), state="attached", attach_id=op.id,
                                     step=op.step, elapsed_s=elapsed_s, joined=joined)
        return pb.AttachResponse(pid=op.pid, state=ATTACHING, phase=phase, phase_s=phase_s, elapsed_s=elapsed_s,
                                 attach_id=op.id, step=op.step, joined=joined)

    @staticmethod
    def _check_wait(w: float) -> float:
        if math.isnan(w) or w < 0:
            raise InputError("wait_s must be >= 0 seconds (0: answer at the attach's end)")
        return min(w, MAX_ATTACH_WAIT_S)

    # ---- RPCs -----------------------------------------------------------------------------
    @rpc
    def Attach(self, request, context):
        check_pid_range(request.pid)
        wait = self._check_wait(request.wait_s)
        op, joined = self.daemon.begin_attach(request.pid, agent=request.agent, cpu_hz=request.cpu_sample_hz or 99,
                                              ops=not request.no_ops, join=wait > 0)
        if not wait:        # an older client: the attach's end is the answer
            self._wait_attach(op, None, None)
        elif not joined:    # the first step (or the end) makes the first answer
            self._wait_attach(op, 0, wait)
        return self._attach_response(op, joined)

    @rpc
    def WaitAttach(self, request, context):
        check_pid_range(request.pid)
        wait = self._check_wait(request.wait_s) or DEFAULT_ATTACH_WAIT_S
        op = self.daemon.attach_op(request.pid, request.attach_id)
        self._wait_attach(op, request.seen_step, wait)
        return self._attach_response(op)

    @rpc
    def Detach(self, request, context):
        check_pid_range(request.pid)
        if request.pid not in self.daemon.attaching:
            return pb.DetachResponse(pid=request.pid, note=self.daemon.detach(request.pid))
        self._attaches.take()      # it waits for the attach it cancels: a worker held, like Attach's
        try:
            return pb.DetachResponse(pid=request.pid, note=self.daemon.detach(request.pid))
        finally:
            self._attaches.give()

    @rpc
    def ListProcesses(self, request, context):
        return pb.ListProcessesResponse(processes=[process_row(self.daemon, info, s)
                                                   for info, s in list_processes(self.daemon)])

    @rpc
    def GetInFlight(self, request, context):
        check_pid_range(request.pid)
        s = self.daemon.session(request.pid)
        read = getattr(s, "in_flight", None)
        if read is None:          # a detached session: nothing is in flight any more
            raise NoSuchProcess(f"{request.pid} is not attached any more: nothing in flight is known")
        now = read()
        out = pb.InFlightResponse(pid=request.pid)
        for w in now["waiting"]:
            out.waiting.add(tid=w["tid"], thread=w["thread"], api=w["api"], since_s=w["since_s"], path=w["path"])
        for x in now["last_launches"]:
            out.last_launches.add(tid=x["tid"], thread=x["thread"], kernel=x["kernel"], ago_s=x["ago_s"],
                                  path=x["path"])
        return out

    @rpc
    def Profile(self, request, context):
        """The window's steps, then its profile (daemon/windows.py). The call's end (a client
        cancelled or killed) sets `gone`: the window ends and lets go of the session."""
        check_pid_range(request.pid)
        spec = WindowSpec(request.pid, request.duration_s, agent=request.agent,
                          cpu_hz=request.cpu_sample_hz or 99, ops=not request.no_ops)
        spec.check()
        self._windows.take()
        gone = threading.Event()
        try:
            with self._lock:
                if self._closed:
                    raise DaemonUnavailable("stacklensd is shutting down")
                self._waits.add(gone)
            if not context.add_callback(gone.set):
                return  # cancelled already
            for step in window_steps(self.daemon, spec, gone):
                if isinstance(step, int):
                    yield pb.ProfileReply(window_id=step)
                elif isinstance(step, str):
                    yield pb.ProfileReply(phase=step)
                else:
                    yield pb.ProfileReply(profile=encode_profile(step))
        finally:
            gone.set()
            with self._lock:
                self._waits.discard(gone)
            self._windows.give()

    @rpc
    def EndWindow(self, request, context):
        check_pid_range(request.pid)
        return pb.EndWindowResponse(note=end_window(request.pid, request.window_id))

    @rpc
    def FindJob(self, request, context):
        check_pid_range(request.launcher_pid)
        if request.launcher_pid <= 0:
            raise InputError("launcher_pid must be a PID")
        host = ProcRankHost(getattr(self.daemon, "procfs", None))
        ranks = find_job(host, request.launcher_pid)
        out = pb.FindJobResponse(launcher_pid=request.launcher_pid, job=ranks[0].job)
        for r in ranks:
            info = out.ranks.add(rank=r.rank, pid=r.pid)
            if r.local_rank is not None:
                info.local_rank = r.local_rank
            if r.world_size is not None:
                info.world_size = r.world_size
        return out

    @rpc
    def GetSnapshot(self, request, context):
        return self._snapshot_response(request)

    @rpc
    def StreamSnapshots(self, request, context):
        if request.interval_ms > MAX_INTERVAL_MS:
            raise InputError(f"interval_ms must be <= {MAX_INTERVAL_MS} (0 = 1000, minimum {MIN_INTERVAL_MS})")
        interval = max(MIN_INTERVAL_MS, request.interval_ms or 1000) / 1000.0
        check_pid_range(request.request.pid)
        self._streams.take()
        wake = threading.Event()
        try:
            with self._lock:
                if self._closed:
                    raise DaemonUnavailable("stacklensd is shutting down")
                self._waits.add(wake)
            if not context.add_callback(wake.set):
                return  # already cancelled
            while not wake.is_set():
                resp = self._snapshot_response(request.request)
                yield resp
                if resp.state != "attached" or wake.wait(interval):
                    break
            if self._closed:
                raise DaemonUnavailable("stacklensd is shutting down: reconnect once it is back")
        finally:
            with self._lock:
                self._waits.discard(wake)
            self._streams.give()

    @rpc
    def GetAdvice(self, request, context):
        """The analyzer's findings on the snapshot GetSnapshot gives for the same pid and window.

        Without an analyzer this is an error, never an empty answer: a wheel that lacked
        stacklens.analyzer.rules made every `advise` say "no findings" (issue 23)."""
        check_pid_range(request.pid)
        advisor = self.advisor
        if advisor is None:
            try:
                from stacklens.analyzer import analyze as advisor
            except ImportError as e:
                raise StacklensError(f"stacklensd cannot load its analyzer ({type(e).__name__}: {e}): the "
                                     "installation is incomplete; reinstall stacklens and restart stacklensd") from e
        snap = self.daemon.snapshot(request.pid, window_s=_check_window(request.window_s))
        return pb.AdviceResponse(pid=request.pid, findings=[finding_to_pb(f) for f in advisor(snap)])

    @rpc
    def Health(self, request, context):
        counters = {k: int(v) for k, v in self.daemon.counters.items()}
        for s in self.daemon.active():
            try:
                for k, v in s.stats().items():
                    counters[k] = counters.get(k, 0) + int(v)
            except StacklensError:
                counters["stats_timeouts"] = counters.get("stats_timeouts", 0) + 1
        return pb.HealthResponse(version=__version__, attached=len(self.daemon.active()), counters=counters)


def add_standard_services(server: grpc.Server):
    """Adds grpc.health.v1.Health and server reflection (v1 and v1alpha) to `server`; returns the
    health servicer, SERVING for "" and stacklens.v1.Stacklens until its `enter_graceful_shutdown()`.
    Reflection describes only what stacklens.proto already publishes, behind the TokenInterceptor
    like every other call; Health answers without the token (`OPEN_METHODS`)."""
    from grpc_health.v1 import health, health_pb2_grpc
    from grpc_reflection.v1alpha import reflection, reflection_pb2_grpc

    stacklens_name = pb.DESCRIPTOR.services_by_name["Stacklens"].full_name
    checker = _health_servicer((health.OVERALL_HEALTH, stacklens_name))
    health_pb2_grpc.add_HealthServicer_to_server(checker, server)
    servicer = _reflection_servicer((stacklens_name, health.SERVICE_NAME, reflection.SERVICE_NAME, REFLECTION_V1))
    reflection_pb2_grpc.add_ServerReflectionServicer_to_server(servicer, server)
    server.add_generic_rpc_handlers((_reflection_v1_handler(servicer),))
    return checker


def _health_servicer(names):
    """grpc's HealthServicer, SERVING for `names`. Watch is open to clients without the token, so it
    is bounded: at most MAX_WATCHES streams, and a name this daemon does not serve gets
    SERVICE_UNKNOWN and the end of its stream (grpc's servicer would keep a set for every name a
    client sends, for ever; the daemon's services never change while it runs)."""
    from grpc_health.v1 import health, health_pb2

    known = frozenset(names)
    slots = _Slots(MAX_WATCHES, f"at most {MAX_WATCHES} health Watch streams at once: use Check, or retry when "
                   "one has ended")

    class BoundedHealth(health.HealthServicer):
        def Watch(self, request, context, send_response_callback=None):
            if request.service not in known:
                unknown = health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVICE_UNKNOWN)
                if send_response_callback is None:
                    return iter((unknown,))
                send_response_callback(unknown)
                send_response_callback(None)    # ends the stream with OK
                return None
            try:
                slots.take()
            except Busy as e:
                _abort(context, e)
            if not context.add_callback(slots.give):  # already over
                slots.give()
            return super().Watch(request, context, send_response_callback)

        def enter_graceful_shutdown(self):
            """NOT_SERVING for every name, sent to the Watch streams outside the servicer's lock.
            grpc's own sends under it, and a send can wait for the server thread, which may be
            waiting for that lock to drop a stream its client cancelled: a daemon stopping just
            after a Watch was cancelled hung in `stop()` (CI, 2 of 4 runs of 2026-12-02)."""
            with self._lock:
                if self._gracefully_shutting_down:
                    return
                self._gracefully_shutting_down = True
                for service in self._server_status:
                    self._server_status[service] = health_pb2.HealthCheckResponse.NOT_SERVING
                sends = [cb for cbs in self._send_response_callbacks.values() for cb in list(cbs)]
            gone = health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.NOT_SERVING)
            for send in sends:
                try:
                    send(gone)
                except Exception:  # noqa: BLE001 - a stream that ended meanwhile
                    pass

    checker = BoundedHealth()  # non-blocking Watch: holds no worker
    for name in names:
        checker.set(name, health_pb2.HealthCheckResponse.SERVING)
    return checker


def _reflection_servicer(names):
    """grpcio-reflection's servicer (v1alpha messages) capped at MAX_REFLECTION streams, which also
    describes grpc.reflection.v1 itself (`_reflection_v1_file`)."""
    from google.protobuf import descriptor_pool
    from grpc_reflection.v1alpha import reflection, reflection_pb2

    slots = _Slots(MAX_REFLECTION, f"at most {MAX_REFLECTION} reflection streams at once: retry when a "
                   "client such as grpcurl has finished")
    v1_file = _reflection_v1_file()
    v1_bytes = v1_file.SerializeToString()
    v1_pool = descriptor_pool.DescriptorPool()
    v1_pool.AddSerializedFile(v1_bytes)

    def v1_answer(request):
        return reflection_pb2.ServerReflectionResponse(
            file_descriptor_response=reflection_pb2.FileDescriptorResponse(file_descriptor_proto=[v1_bytes]),
            original_request=request)

    class CappedReflection(reflection.ReflectionServicer):
        def ServerReflectionInfo(self, request_iterator, context):
            try:
                slots.take()
            except Busy as e:
                _abort(context, e)
            try:
                yield from super().ServerReflectionInfo(request_iterator, context)
            finally:
                slots.give()

        def _file_by_filename(self, request, filename):
            if filename == v1_file.name:
                return v1_answer(request)
            return super()._file_by_filename(request, filename)

        def _file_containing_symbol(self, request, fully_qualified_name):
            try:
                v1_pool.FindFileContainingSymbol(fully_qualified_name)
            except KeyError:
                return super()._file_containing_symbol(request, fully_qualified_name)
            return v1_answer(request)

    return CappedReflection(names)


def _reflection_v1_file():
    """grpc.reflection.v1's reflection.proto, made from v1alpha's by renaming its package: the two
    are wire-identical (same messages, field names, numbers and types; compared with grpc's
    src/proto/grpc/reflection/v1/reflection.proto, and by tests/unit/test_grpc_standard.py against
    a v1 client built from that file's fields). grpcio-reflection ships only v1alpha up to at least
    1.85; grpcurl and newer clients ask v1 first."""
    from google.protobuf import descriptor_pb2
    from grpc_reflection.v1alpha import reflection_pb2

    fd = descriptor_pb2.FileDescriptorProto()
    reflection_pb2.DESCRIPTOR.CopyToProto(fd)
    old, new = fd.package, REFLECTION_V1.rsplit(".", 1)[0]
    fd.name = fd.name.replace("v1alpha", "v1")
    fd.package = new
    fd.ClearField("options")
    for m in fd.message_type:
        for f in m.field:
            if f.type_name.startswith(f".{old}."):
                f.type_name = f".{new}." + f.type_name[len(old) + 2:]
    for s in fd.service:
        for meth in s.method:
            meth.input_type = meth.input_type.replace(f".{old}.", f".{new}.")
            meth.output_type = meth.output_type.replace(f".{old}.", f".{new}.")
    return fd


def _reflection_v1_handler(servicer) -> grpc.GenericRpcHandler:
    """grpc.reflection.v1.ServerReflection served by the v1alpha servicer: the bytes on the wire
    are the same, so v1alpha's message classes decode and encode them."""
    from grpc_reflection.v1alpha import reflection_pb2

    info = grpc.stream_stream_rpc_method_handler(
        servicer.ServerReflectionInfo,
        request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
        response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString)
    return grpc.method_handlers_generic_handler(REFLECTION_V1, {"ServerReflectionInfo": info})


def finding_to_pb(f) -> pb.Finding:
    return pb.Finding(
        rule=f.rule,
        severity=str(f.severity),
        path=list(f.path),
        title=f.title,
        fix=f.fix,
        estimated_saving_share=float(f.estimated_saving or 0.0),
        evidence=[pb.Evidence(metric=k, value=float(v), unit="") for k, v in f.evidence.items()],
    )


class TokenInterceptor(grpc.ServerInterceptor):
    """Refuses every call without the daemon's bearer token (UNAUTHENTICATED), but OPEN_METHODS."""

    def __init__(self, token: str) -> None:
        self._expected = f"Bearer {token}".encode()

        def deny(request, context):
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong token: read it from the daemon's token file")

        # a handler of the method's own kind: a streaming request is refused without waiting for it
        self._deny = {
            (False, False): grpc.unary_unary_rpc_method_handler(deny),
            (False, True): grpc.unary_stream_rpc_method_handler(deny),
            (True, False): grpc.stream_unary_rpc_method_handler(deny),
            (True, True): grpc.stream_stream_rpc_method_handler(deny),
        }

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler_call_details.method in OPEN_METHODS:
            return handler
        md = dict(handler_call_details.invocation_metadata or ())
        got = md.get("authorization", "")
        if isinstance(got, str) and hmac.compare_digest(got.encode(), self._expected):
            return handler
        if handler is None:
            return self._deny[(False, False)]
        return self._deny[(handler.request_streaming, handler.response_streaming)]
