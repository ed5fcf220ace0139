"""The gRPC service stacklens.v1.Stacklens over a `Daemon`: its RPCs, and the worker budget of every service.

Its parts, one concern each: `grpc_auth.py` (the bearer token on every call but health's,
`TokenInterceptor`), `grpc_calls.py` (error → status mapping in one place, `rpc`; `Slots` bounding
long-lived calls; grpc's log of undecodable requests, `install_log_filters`), `grpc_messages.py`
(bounds on requests, responses built: `prune`, `finding_to_pb`) and `grpc_standard.py` (health and
reflection beside this service, `add_standard_services`). Their public names are importable from
here too.

Workers: unary calls must never wait behind long-lived calls, so `StreamSnapshots` is capped at
MAX_STREAMS concurrent streams, Attach and WaitAttach calls that wait at MAX_ATTACHES and
reflection at MAX_REFLECTION streams (RESOURCE_EXHAUSTED beyond, with what to do); health Watch
streams hold no worker (grpc's non-blocking handler; at most MAX_WATCHES). The server has WORKERS
threads, so at least WORKERS - MAX_STREAMS - MAX_ATTACHES - MAX_REFLECTION are always free for the
rest. An attach itself runs on a thread of the daemon's (attachop.AttachOp), not on a worker: a
client waits for it at most MAX_ATTACH_WAIT_S per call and follows it with WaitAttach. A stream
waits between snapshots on an Event that its cancellation (`context.add_callback`) and `close()`
(daemon stop) set, so it gives its worker back at once.
Errors: StacklensError → its status code; anything else → INTERNAL with a short message naming
the RPC (the exception text stays in the daemon's log, logged once with its traceback).
"""

from __future__ import annotations

import threading

import grpc

from stacklens import __version__
from stacklens.cct import diff
from stacklens.cct.export import encode_profile
from stacklens.daemon import grpc_standard
from stacklens.daemon import stacklens_pb2 as pb
from stacklens.daemon import stacklens_pb2_grpc as pbg
from stacklens.daemon.attachop import AttachOp
from stacklens.daemon.core import Daemon
from stacklens.daemon.grpc_auth import OPEN_METHODS, TokenInterceptor  # noqa: F401 — re-exported
from stacklens.daemon.grpc_calls import Busy, Slots, install_log_filters, rpc  # noqa: F401 — re-exported
from stacklens.daemon.grpc_messages import (MAX_ATTACH_WAIT_S, MAX_WINDOW_S, attach_response,  # noqa: F401
                                            check_wait, check_window, finding_to_pb, prune)
from stacklens.daemon.grpc_standard import REFLECTION_V1  # noqa: F401 — re-exported
from stacklens.daemon.pslist import list_processes, process_row
from stacklens.introspect.ranks import ProcRankHost, find_job
from stacklens.daemon.windows import WindowSpec, end_window, window_steps
from stacklens.errors import DaemonUnavailable, InputError, NoSuchProcess, StacklensError
from stacklens.introspect.procfs import check_pid_range

MAX_INTERVAL_MS = 60_000  # a stream's interval; longer than the largest window is pointless
MIN_INTERVAL_MS = 100
WORKERS = 32
MAX_STREAMS = 8
MAX_ATTACHES = 16
MAX_WINDOWS = 8     # profile windows at once (each holds a worker for its length)
MAX_REFLECTION = 2  # a reflection client holds its stream (and a worker) while it asks
MAX_WATCHES = 64    # health Watch streams (open without the token; they hold no worker)
DEFAULT_ATTACH_WAIT_S = 10.0


class StacklensServicer(pbg.StacklensServicer):
    """The RPCs of stacklens.v1.Stacklens over `daemon`; `advisor` is the analyzer (None: GetAdvice
    imports it, an error if it cannot)."""

    def __init__(self, daemon: Daemon, advisor=None) -> None:
        self.daemon = daemon
        self.advisor = advisor
        self.seq = 0
        self._streams = Slots(MAX_STREAMS, f"at most {MAX_STREAMS} snapshot streams at once: close a "
                              "`stacklens top` or poll with GetSnapshot")
        self._attaches = Slots(MAX_ATTACHES, f"at most {MAX_ATTACHES} attaches in flight: retry when one "
                               "has finished")
        self._windows = Slots(MAX_WINDOWS, f"at most {MAX_WINDOWS} profile windows at once: retry when one "
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
        window = check_window(req.window_s)
        dwin = check_window(req.diff_window_s, "diff_window_s")
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

    # ---- RPCs -----------------------------------------------------------------------------
    @rpc
    def Attach(self, request, context):
        check_pid_range(request.pid)
        wait = check_wait(request.wait_s)
        op, joined = self.daemon.begin_attach(request.pid, agent=request.agent, cpu_hz=request.cpu_sample_hz or 99,
                                              ops=not request.no_ops, join=wait > 0)
        if not wait:        # an older client: the attach's end is the answer
            self._wait_attach(op, None, None)
        elif not joined:    # the first step (or the end) makes the first answer
            self._wait_attach(op, 0, wait)
        return attach_response(op, joined)

    @rpc
    def WaitAttach(self, request, context):
        check_pid_range(request.pid)
        wait = check_wait(request.wait_s) or DEFAULT_ATTACH_WAIT_S
        op = self.daemon.attach_op(request.pid, request.attach_id)
        self._wait_attach(op, request.seen_step, wait)
        return attach_response(op)

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
        snap = self.daemon.snapshot(request.pid, window_s=check_window(request.window_s))
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
    """Adds grpc.health.v1.Health and server reflection (v1 and v1alpha) to `server`
    (`grpc_standard.py`), capped at MAX_WATCHES and MAX_REFLECTION streams; returns the health
    servicer, SERVING until its `enter_graceful_shutdown()`."""
    # the caps are read here, at the call, and kept with the rest of the worker budget
    return grpc_standard.add_standard_services(server, max_watches=MAX_WATCHES, max_reflection=MAX_REFLECTION)
