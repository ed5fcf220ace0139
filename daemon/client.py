"""gRPC client of stacklensd, used by the CLI and the TUI. Needs read access to the daemon's token.

gRPC status codes come back as the matching `stacklens.errors` class, so callers see one hierarchy.
The token is `SOCKNAME.d/token` beside the socket when the daemon had to make that directory (its
socket sits in a directory it does not own, e.g. /tmp), else `token` beside the socket
(daemon/server.py, "Socket directory").
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Iterator

import grpc

from stacklens import errors
from stacklens.cct import Snapshot
from stacklens.cct.export import decode_profile as _decode_profile
from stacklens.daemon import stacklens_pb2 as pb
from stacklens.daemon import stacklens_pb2_grpc as pbg
from stacklens.introspect.procfs import check_pid_range

TOKEN_NAME = "token"
ATTACH_POLL_S = 10.0    # one Attach/WaitAttach call waits at most this long for the next step
ATTACH_STALL_S = 600.0  # a client stops following an attach whose step lasts longer than this
RPC_SLACK_S = 30.0      # on top of a call's own wait: a daemon on a loaded machine answers late
JOB_ATTACHES = 8        # attach --job: ranks attached at once (the daemon takes MAX_ATTACHES)


def token_subdir(sock: Path | str) -> str:
    """Name of the daemon-owned directory for the token beside a socket in a shared directory."""
    return f"{Path(sock).name}.d"


def token_candidates(sock: Path | str) -> list[Path]:
    """Where the token of the daemon at `sock` may be, in the order clients look."""
    sock = Path(sock)
    return [sock.parent / token_subdir(sock) / TOKEN_NAME, sock.parent / TOKEN_NAME]


_STATUS_TO_ERROR = {
    grpc.StatusCode.INVALID_ARGUMENT: errors.InputError,
    grpc.StatusCode.NOT_FOUND: errors.NoSuchProcess,
    grpc.StatusCode.PERMISSION_DENIED: errors.PermissionDenied,
    grpc.StatusCode.UNAUTHENTICATED: errors.PermissionDenied,
    grpc.StatusCode.FAILED_PRECONDITION: errors.AttachError,
    grpc.StatusCode.ALREADY_EXISTS: errors.AlreadyAttached,
    grpc.StatusCode.UNAVAILABLE: errors.DaemonUnavailable,
    grpc.StatusCode.DEADLINE_EXCEEDED: errors.Timeout,
    grpc.StatusCode.ABORTED: errors.AttachCancelled,
}  # RESOURCE_EXHAUSTED, INTERNAL: StacklensError with the daemon's message


def _translate(e: grpc.RpcError, socket_path: str, what: str = "", timeout: float | None = None) -> errors.StacklensError:
    code = e.code()
    cls = _STATUS_TO_ERROR.get(code, errors.StacklensError)
    msg = e.details() or str(code)
    if code == grpc.StatusCode.UNAVAILABLE:
        msg = f"stacklensd is not reachable at {socket_path}: start it (`stacklensd` or `systemctl start stacklensd`) or pass --socket"
    elif code == grpc.StatusCode.DEADLINE_EXCEEDED and msg == "Deadline Exceeded":   # grpc's own, says nothing
        msg = (f"stacklensd did not answer {what or 'the call'} within {timeout or 0:g}s (a busy machine, or a "
               "session that has just attached reads its symbols first): try again; `stacklens ps` shows the state")
    return cls(msg)


def decode_profile(data: bytes) -> Snapshot:
    """`SnapshotResponse.profile` as a Snapshot: gzip of the columnar form (cct/export.py) or,
    from older daemons, of stacklens JSON. InputError for anything else."""
    return _decode_profile(data)


def check_owner(path: Path | str, what: str) -> None:
    """A stacklensd socket or token that another user owns is not trusted (it could be a planted
    stand-in): root's, or this user's own (a daemon they started), or it is refused."""
    try:
        uid = os.lstat(path).st_uid
    except OSError:
        return                        # missing: the connection says so
    if uid not in (0, os.geteuid()):
        raise errors.PermissionDenied(f"the stacklensd {what} {path} belongs to uid {uid}, neither root nor you: "
                                      "not trusted (a stand-in another user could have made); check `ls -l` "
                                      "and give the daemon's own with --socket")



@contextlib.contextmanager
def _sigint(handler):
    """`handler` for SIGINT inside the block, on the main thread (elsewhere: unchanged)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = signal.signal(signal.SIGINT, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, old)

class DaemonClient:
    def __init__(self, socket_path: str, *, timeout: float = 15.0, token: str | None = None) -> None:
        self.socket_path = socket_path
        self.timeout = timeout
        check_owner(socket_path, "socket")
        if token is None:
            cands = token_candidates(socket_path)
            tok = next((c for c in cands if os.path.lexists(c)), cands[-1])
            check_owner(tok, "token")
            try:
                token = tok.read_text().strip()
            except FileNotFoundError:
                raise errors.DaemonUnavailable(
                    f"stacklensd is not running (no {tok}): start it (`stacklensd` or `systemctl start stacklensd`)"
                ) from None
            except PermissionError:
                raise errors.PermissionDenied(
                    f"cannot read {tok}: run as root or join the `stacklens` group"
                ) from None
        self._md = (("authorization", f"Bearer {token}"),)
        self.channel = grpc.insecure_channel(f"unix:{socket_path}")
        self.stub = pbg.StacklensStub(self.channel)

    def __enter__(self) -> "DaemonClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self.channel.close()

    def _call(self, method, req, timeout: float | None = None):
        timeout = timeout or self.timeout
        try:
            return method(req, timeout=timeout, metadata=self._md)
        except grpc.RpcError as e:
            raise _translate(e, self.socket_path, type(req).__name__.removesuffix("Request"), timeout) from None

    def attach(self, pid: int, *, agent: bool = False, cpu_hz: int = 0, no_ops: bool = False,
               wait_s: float | None = None, stall_s: float = ATTACH_STALL_S,
               on_progress: Callable[[pb.AttachResponse], None] | None = None) -> list[str]:
        """Has the daemon attach to `pid` (or joins its attach of `pid` in progress) and follows
        it to its end: returns its notes, or raises its error. `on_progress` hears each answer
        while it goes on. Raises StillAttaching when `wait_s` (None: no limit) has passed first,
        or one step has lasted `stall_s`: the attach goes on in the daemon."""
        check_pid_range(pid)  # the gRPC field is an int32: refuse what it cannot carry here
        t0 = time.monotonic()
        poll = ATTACH_POLL_S if wait_s is None else max(0.001, min(ATTACH_POLL_S, wait_s))
        r = self._call(self.stub.Attach, pb.AttachRequest(pid=pid, agent=agent, cpu_sample_hz=cpu_hz, no_ops=no_ops,
                                                          wait_s=poll), timeout=max(120.0, poll + RPC_SLACK_S))
        while r.state == "attaching":
            if on_progress is not None:
                on_progress(r)
            left = None if wait_s is None else wait_s - (time.monotonic() - t0)
            if (left is not None and left <= 0) or r.phase_s >= stall_s:
                why = (f"it has been in this step for {r.phase_s:.0f}s" if r.phase_s >= stall_s
                       else f"this client waited {wait_s:g}s")
                raise errors.StillAttaching(
                    f"the attach of {pid} goes on in stacklensd (step '{r.phase}', {r.elapsed_s:.0f}s so far) "
                    f"but {why}: `stacklens ps` shows it attaching, `stacklens attach {pid}` follows it "
                    f"again, `stacklens detach {pid}` cancels it")
            poll = ATTACH_POLL_S if left is None else max(0.001, min(ATTACH_POLL_S, left))
            r = self._call(self.stub.WaitAttach, pb.WaitAttachRequest(pid=pid, attach_id=r.attach_id, seen_step=r.step,
                                                                      wait_s=poll), timeout=poll + RPC_SLACK_S)
        return list(r.notes)

    def profile(self, pid: int, *, duration_s: float, agent: bool = False, cpu_hz: int = 0, no_ops: bool = False,
                on_phase: Callable[[str], None] | None = None) -> Snapshot:
        """A profile window of `duration_s` on `pid` held by this call (daemon/windows.py): the
        window's profile; `on_phase` hears its steps. Ending this client ends the window. On the
        main thread, a first SIGINT (Ctrl-C) ends the window now and its profile up to then is
        returned; a second one interrupts."""
        check_pid_range(pid)
        req = pb.ProfileRequest(pid=pid, duration_s=duration_s, agent=agent, cpu_sample_hz=cpu_hz, no_ops=no_ops)
        window = {"id": 0, "ending": False}

        def end_now(_sig, _frame) -> None:
            if window["ending"] or not window["id"]:
                raise KeyboardInterrupt
            window["ending"] = True
            if on_phase is not None:
                on_phase("ending the window now (Ctrl-C again abandons it)")
            threading.Thread(target=self._end_window, args=(pid, window["id"]), daemon=True).start()

        try:
            with _sigint(end_now):
                for r in self.stub.Profile(req, metadata=self._md):
                    if r.profile:
                        return decode_profile(r.profile)
                    if r.window_id:
                        window["id"] = r.window_id
                    elif on_phase is not None:
                        on_phase(r.phase)
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.UNIMPLEMENTED:
                raise errors.DaemonUnavailable(
                    "this stacklensd has no profile windows (an older version): restart it from this "
                    "installation, or profile with --no-daemon") from None
            raise _translate(e, self.socket_path, "Profile") from None
        raise errors.StacklensError(f"stacklensd ended the window on {pid} without a profile: `stacklens ps` "
                                    "shows its state")

    def _end_window(self, pid: int, window_id: int) -> None:
        try:
            self._call(self.stub.EndWindow, pb.EndWindowRequest(pid=pid, window_id=window_id), timeout=30)
        except errors.StacklensError:
            pass        # the window ended meanwhile: its profile comes all the same

    def in_flight(self, pid: int) -> pb.InFlightResponse:
        """An attached process's calls still waiting and each thread's last launch (the probes')."""
        check_pid_range(pid)
        return self._call(self.stub.GetInFlight, pb.InFlightRequest(pid=pid), timeout=30)

    def find_job(self, launcher: int) -> pb.FindJobResponse:
        """The torch.distributed ranks under a launcher PID (introspect/ranks.py), by rank."""
        check_pid_range(launcher)
        return self._call(self.stub.FindJob, pb.FindJobRequest(launcher_pid=launcher))

    def detach(self, pid: int) -> str:
        """Detaches `pid`, or cancels its attach in progress; what happened, in a line."""
        check_pid_range(pid)
        r = self._call(self.stub.Detach, pb.DetachRequest(pid=pid), timeout=120)
        return r.note or f"detached from {pid}"

    def processes(self) -> list[pb.ProcessInfo]:
        return list(self._call(self.stub.ListProcesses, pb.ListProcessesRequest()).processes)

    def snapshot_response(self, pid: int, **kw) -> pb.SnapshotResponse:
        check_pid_range(pid)
        req = pb.SnapshotRequest(pid=pid, **{k: v for k, v in kw.items() if v is not None})
        return self._call(self.stub.GetSnapshot, req)

    def snapshot(self, pid: int, window_s: float | None = None, **kw) -> Snapshot:
        return decode_profile(self.snapshot_response(pid, window_s=window_s or 0.0, **kw).profile)

    def stream(self, pid: int, interval_ms: int = 1000, **kw) -> Iterator[pb.SnapshotResponse]:
        check_pid_range(pid)
        req = pb.StreamRequest(request=pb.SnapshotRequest(pid=pid, **kw), interval_ms=interval_ms)
        try:
            yield from self.stub.StreamSnapshots(req, metadata=self._md)
        except grpc.RpcError as e:
            raise _translate(e, self.socket_path) from None

    def advice(self, pid: int, window_s: float = 0.0) -> list[pb.Finding]:
        check_pid_range(pid)
        return list(self._call(self.stub.GetAdvice, pb.AdviceRequest(pid=pid, window_s=window_s), timeout=60).findings)

    def health(self) -> pb.HealthResponse:
        return self._call(self.stub.Health, pb.HealthRequest())


STATE_COLUMN_MAX = 14  # "not attached", "detached", "exited" fit; longer states get a line of their own


def ps_lines(rows) -> list[str]:
    """`stacklens ps` as lines. The STATE column is as wide as its short states; a longer one (an
    error with its reason) shows its first word there and the whole text on the next line:
    never cut (a cut "error: ind" told nothing)."""
    from stacklens.textsafe import safe_text

    states = [safe_text(p.state) for p in rows]
    heads = [st if len(st) <= STATE_COLUMN_MAX else st.split(":", 1)[0][:STATE_COLUMN_MAX] for st in states]
    width = max([5] + [len(h) for h in heads])    # a long state's first word fits whole
    out = [f"{'PID':>8} {'COMM':16} {'STATE':{width}} {'AGENT':5} {'GPU%':>6} {'LAUNCH/s':>9} {'SYNC%':>6} "
           f"{'COST%':>6} {'RANK':>5}  PYTHON"]
    for p, st, short in zip(rows, states, heads):
        share = p.gpu_time_share if not hasattr(p, "HasField") or p.HasField("gpu_time_share") else math.nan
        gpu = "n/a" if math.isnan(share) else f"{100 * share:.1f}"   # unset: not measured; NaN: an older daemon
        out.append(f"{p.pid:>8} {p.comm[:16]:16} {short:{width}} {'yes' if p.agent else 'no':5} {gpu:>6} "
                   f"{p.launches_per_s:>9.1f} {100 * p.sync_wait_share:>6.1f} {_cost_text(p):>6} {_rank_text(p):>5}  "
                   f"{p.python}")
        if short != st:
            out.append(f"{'':8} state: {st}")
        if getattr(p, "overhead_note", ""):
            out.append(f"{'':8} cost: {p.overhead_note}")
        held = list(getattr(p, "held_by", ()))
        if held and held != ["attach"]:     # a profile window holds it (it ends with the window)
            out.append(f"{'':8} held by: {', '.join(held)}")
    if not rows:
        out.append("(no process with a GPU driver, torch or JAX loaded, and nothing attached)")
    return out


def _cost_text(p) -> str:
    """COST%: the probes' estimated cost, % of the process's CPU time (daemon/overhead.py);
    "n/a" where it is not measured (the next line says why), "-" for a process not attached."""
    if hasattr(p, "HasField") and p.HasField("probe_overhead"):
        return f"{100 * p.probe_overhead:.1f}"
    return "n/a" if getattr(p, "overhead_note", "") else "-"


def _rank_text(p) -> str:
    """RANK/WORLD_SIZE of a torch.distributed rank, '-' for other processes (and older daemons)."""
    if not hasattr(p, "HasField") or "rank" not in p.DESCRIPTOR.fields_by_name or not p.HasField("rank"):
        return "-"
    return f"{p.rank}/{p.world_size}" if p.HasField("world_size") else str(p.rank)


def _attach_progress(pid: int) -> Callable[[pb.AttachResponse], None]:
    """`stacklens attach`'s progress on stderr: a line per step, and one per answer while a step
    lasts (ATTACH_POLL_S apart), so a slow attach never looks hung."""
    seen = {"step": -1}

    def show(r: pb.AttachResponse) -> None:
        if r.joined and seen["step"] < 0:
            print(f"stacklens: an attach of {pid} was in progress already: following it", file=sys.stderr)
        still = "" if r.step != seen["step"] else f" (still, {r.phase_s:.0f}s in this step)"
        seen["step"] = r.step
        print(f"stacklens: [{r.elapsed_s:6.1f}s] attaching to {pid}: {r.phase}{still}", file=sys.stderr, flush=True)

    return show


def run_client_command(args, socket_path: str) -> int:
    from stacklens.render.textreport import short_note

    with DaemonClient(socket_path) as c:
        if args.command == "attach" and getattr(args, "job", False):
            return _attach_job(c, args)
        if args.command == "attach":
            for note in c.attach(args.pid, agent=args.agent, wait_s=args.wait, on_progress=_attach_progress(args.pid)):
                print(short_note(note, args.pid))   # whole in `stacklens doctor --pid PID`
            print(f"attached to {args.pid}")
        elif args.command == "detach":
            print(c.detach(args.pid))
        else:
            raise errors.InputError(f"unknown command {args.command}")
    return 0


def _attach_job(c: DaemonClient, args) -> int:
    """`stacklens attach --job LAUNCHER`: every rank under it, at once (the daemon compiles one
    program for their CPython build, the attaches share it). A rank that cannot be attached (it
    exited, it is refused) is said with its error; the others stay attached. The exit code is
    the first failure's by rank, 0 when every rank is attached."""
    from concurrent.futures import ThreadPoolExecutor

    job = c.find_job(args.pid)
    print(f"job under {args.pid} ({job.job}): ranks "
          + ", ".join(f"{r.rank} (PID {r.pid})" for r in job.ranks), file=sys.stderr)

    def one(r) -> errors.StacklensError | str | None:
        try:
            c.attach(r.pid, agent=args.agent, wait_s=args.wait, on_progress=_attach_progress(r.pid))
        except errors.AlreadyAttached:
            return "attached already"
        except errors.StacklensError as e:
            return e
        return None

    with ThreadPoolExecutor(max_workers=min(JOB_ATTACHES, len(job.ranks))) as pool:
        results = list(pool.map(one, job.ranks))
    failed = [e for e in results if isinstance(e, errors.StacklensError)]
    for r, res in zip(job.ranks, results):
        what = "attached" if res is None else res if isinstance(res, str) else f"not attached: {res}"
        print(f"rank {r.rank} (PID {r.pid}): {what}")
    print(f"attached {len(job.ranks) - len(failed)} of {len(job.ranks)} ranks")
    return failed[0].exit_code if failed else 0
