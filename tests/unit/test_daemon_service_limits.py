"""stacklensd's service limits on a real gRPC server (fake probes behind the Protocol):

- streams: bounded interval, at most MAX_STREAMS at once (RESOURCE_EXHAUSTED beyond), a cancelled
  stream gives its worker back at once, stop() ends open streams, unary calls always answer;
- errors: an unexpected exception is INTERNAL with a short message (no exception text), logged
  once; undecodable requests are one log line, not a traceback each; PIDs out of range refused;
- `stacklensd --socket DIR/s.sock` leaves a shared 1777 DIR's mode and owner as they were;
- a SIGTERM that the kernel hands to a thread other than the main one still stops the daemon.
"""

from __future__ import annotations

import logging
import os
import ctypes
import signal
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest

from stacklens.daemon import grpc_calls, grpc_service
from stacklens.daemon import stacklens_pb2 as pb
from stacklens.daemon.client import DaemonClient
from stacklens.errors import InputError, StacklensError
from tests.grpc_daemon import serving

BIN = Path(sys.executable).parent


def _stream(c: DaemonClient, pid: int, interval_ms: int):
    req = pb.StreamRequest(request=pb.SnapshotRequest(pid=pid), interval_ms=interval_ms)
    return c.stub.StreamSnapshots(req, metadata=c._md)


def _timed(fn):
    t0 = time.monotonic()
    out = fn()
    return out, time.monotonic() - t0


def _wait_for(pred, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


@pytest.mark.timeout(120)
def test_streams_are_capped_cancelled_at_once_and_never_starve_unary_calls(daemon, target):
    with DaemonClient(str(daemon.socket_path), timeout=10) as c:
        c.attach(target)
        with pytest.raises(InputError, match="interval_ms"):
            next(iter(c.stream(target, interval_ms=grpc_service.MAX_INTERVAL_MS + 1)))
        calls, refused = [], 0
        for _ in range(64):  # the largest interval: without the fix each would hold a worker for a minute
            call = _stream(c, target, grpc_service.MAX_INTERVAL_MS)
            try:
                first = next(call)
                assert first.pid == target
                calls.append(call)
            except grpc.RpcError as e:
                assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, e
                assert "snapshot streams" in e.details()
                refused += 1
            _, took = _timed(c.processes)
            assert took < 2.0, f"ps took {took:.2f} s with {len(calls)} streams open"
        assert len(calls) == grpc_service.MAX_STREAMS and refused == 64 - grpc_service.MAX_STREAMS
        # attach answers at once (a refusal here: the point is that a worker is free for it)
        with pytest.raises(InputError):
            _timed(lambda: c.attach(2))
        _, took = _timed(c.health)
        assert took < 2.0
        for call in calls:
            call.cancel()
        servicer = daemon.servicer
        _wait_for(lambda: servicer._streams.used == 0, 30.0, "cancelled streams still hold their workers")
        again = [_stream(c, target, grpc_service.MAX_INTERVAL_MS) for _ in range(grpc_service.MAX_STREAMS)]
        for call in again:
            assert next(call).pid == target
        # stop() ends open streams at once, whatever the clients do (they just keep waiting)
        _, took = _timed(daemon.stop)
        assert took < 5.0, f"stop took {took:.2f} s with {len(again)} streams open"
        for call in again:
            with pytest.raises(grpc.RpcError):
                next(call)


def test_a_stream_ends_when_its_session_ends(daemon, target):
    with DaemonClient(str(daemon.socket_path), timeout=10) as c:
        c.attach(target)
        call = _stream(c, target, 100)
        assert next(call).state == "attached"
        c.detach(target)
        states = [r.state for r in call]
        assert states and states[-1] == "detached"
        _wait_for(lambda: daemon.servicer._streams.used == 0, 30.0, "stream slot not given back")


def test_unexpected_errors_are_internal_short_and_logged_once(tmp_path, target, caplog):
    def broken(pid, **kw):
        raise RuntimeError("secret detail: /etc/shadow line 3")

    with serving(tmp_path, broken) as d:
        with caplog.at_level(logging.INFO), DaemonClient(str(d.socket_path)) as c:
            with pytest.raises(StacklensError) as e:
                c.attach(target)
            assert "internal error in Attach (RuntimeError)" in str(e.value)
            assert "secret" not in str(e.value) and "shadow" not in str(e.value)
            assert c.health().counters["attach_failures"] == 1  # still serving
    logged = [r for r in caplog.records if r.exc_info or "Attach" in r.getMessage()]
    assert len(logged) == 1 and logged[0].name == "stacklens.daemon.grpc_service", \
        [(r.name, r.getMessage()) for r in logged]


def test_undecodable_requests_log_one_line_not_a_traceback_each(daemon, target, caplog):
    grpc_calls._FILTER._last = float("-inf")  # a fresh rate window for this test
    with caplog.at_level(logging.INFO), DaemonClient(str(daemon.socket_path)) as c:
        raw = c.channel.unary_unary("/stacklens.v1.Stacklens/GetSnapshot", request_serializer=None,
                                    response_deserializer=None)
        for _ in range(20):
            with pytest.raises(grpc.RpcError):
                raw(b"\xff\xff\xff\xff garbage", metadata=c._md, timeout=5)
        # a PID beyond int32 on the wire (varint 2**31 in the int32 field): a clear refusal
        attach = c.channel.unary_unary("/stacklens.v1.Stacklens/Attach", request_serializer=None,
                                       response_deserializer=None)
        with pytest.raises(grpc.RpcError) as e:
            attach(b"\x08\x80\x80\x80\x80\x08", metadata=c._md, timeout=5)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "invalid PID" in e.value.details()
        with pytest.raises(InputError, match="invalid PID"):
            c.attach(2**31)  # the client library refuses it before protobuf would raise ValueError
        assert c.health().version
    about = [r for r in caplog.records if "deserializ" in r.getMessage() or "malformed" in r.getMessage()]
    assert len(about) == 1, [r.getMessage() for r in about]
    assert about[0].exc_info is None and "\n" not in about[0].getMessage()


def test_cli_refuses_pids_out_of_range_without_a_traceback(tmp_path):
    for arg in ("2147483648", "99999999999999999999", "0", "-3", "12abc"):
        r = subprocess.run([str(BIN / "stacklens"), "--socket", str(tmp_path / "none.sock"), "attach", "--", arg],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 64, (arg, r.stdout, r.stderr)
        assert "Traceback" not in r.stderr and "invalid PID" in r.stderr, r.stderr


@pytest.fixture
def shared_dir(tmp_path):
    """A /tmp-like directory: 1777, owned by another user (nobody)."""
    d = tmp_path / "shared"
    d.mkdir()
    os.chmod(d, 0o1777)
    try:
        os.chown(d, 65534, 65534)
    except PermissionError:
        pytest.skip("needs root (chown to nobody) to make a directory of another user")
    return d


def _start_stacklensd(sock: Path, log: Path) -> subprocess.Popen:
    fh = open(log, "w")
    return subprocess.Popen([str(BIN / "stacklensd"), "--socket", str(sock), "--metrics-address", "off"],
                            stdout=subprocess.PIPE, stderr=fh, text=True)


@pytest.mark.timeout(120)
def test_socket_in_a_shared_sticky_dir_leaves_its_mode_and_owner_alone(shared_dir, tmp_path):
    before = os.stat(shared_dir)
    sock = shared_dir / "s.sock"
    proc = _start_stacklensd(sock, tmp_path / "d.log")
    try:
        line = proc.stdout.readline()
        assert "ready" in line, (line, (tmp_path / "d.log").read_text())
        after = os.stat(shared_dir)
        assert (after.st_mode, after.st_uid, after.st_gid) == (before.st_mode, before.st_uid, before.st_gid)
        tok = shared_dir / "s.sock.d" / "token"
        assert stat.S_IMODE(os.stat(tok).st_mode) == 0o640
        assert stat.S_IMODE(os.stat(tok.parent).st_mode) == 0o750 and os.stat(tok.parent).st_uid == os.geteuid()
        assert stat.S_IMODE(os.stat(sock).st_mode) & 0o007 == 0
        r = subprocess.run([str(BIN / "stacklens"), "--socket", str(sock), "ps"], capture_output=True, text=True,
                           timeout=60)
        assert r.returncode == 0, r.stderr  # the CLI finds the token in s.sock.d/
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0
        after = os.stat(shared_dir)
        assert (after.st_mode, after.st_uid, after.st_gid) == (before.st_mode, before.st_uid, before.st_gid)
        assert not sock.exists() and not tok.exists()
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        proc.stdout.close()


def _tgkill(tgid: int, tid: int, sig: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.syscall(234, tgid, tid, sig) != 0:  # SYS_tgkill on x86_64
        raise OSError(ctypes.get_errno(), "tgkill")


@pytest.mark.timeout(120)
def test_sigterm_delivered_to_another_thread_stops_the_daemon(tmp_path):
    """The kernel may give a process's SIGTERM to any of its threads (CI saw it while the warm-up
    compiled); the main thread must not sleep through it."""
    proc = _start_stacklensd(tmp_path / "s.sock", tmp_path / "d.log")
    try:
        assert "ready" in proc.stdout.readline(), (tmp_path / "d.log").read_text()
        others = sorted(int(t) for t in os.listdir(f"/proc/{proc.pid}/task") if int(t) != proc.pid)
        assert others, "stacklensd runs its server and housekeeping on threads of their own"
        _tgkill(proc.pid, others[-1], signal.SIGTERM)
        try:
            rc = proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            pytest.fail("stacklensd slept through a SIGTERM handed to thread %d: %s"
                        % (others[-1], (tmp_path / "d.log").read_text()))
        assert rc == 0, (tmp_path / "d.log").read_text()
        assert not (tmp_path / "s.sock").exists()
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        proc.stdout.close()


def test_a_world_writable_dir_without_sticky_bit_and_a_foreign_file_are_refused(shared_dir, tmp_path):
    os.chmod(shared_dir, 0o777)
    proc = _start_stacklensd(shared_dir / "s.sock", tmp_path / "d1.log")
    assert proc.wait(timeout=60) == 2
    proc.stdout.close()
    assert "not sticky" in (tmp_path / "d1.log").read_text()
    assert stat.S_IMODE(os.stat(shared_dir).st_mode) == 0o777 and not (shared_dir / "s.sock.d").exists()
    os.chmod(shared_dir, 0o1777)
    victim = shared_dir / "notes.txt"
    victim.write_text("someone's file")
    proc = _start_stacklensd(victim, tmp_path / "d2.log")
    assert proc.wait(timeout=60) == 2
    proc.stdout.close()
    assert "is not a stacklensd socket" in (tmp_path / "d2.log").read_text()
    assert victim.read_text() == "someone's file"
