"""stacklensd's gRPC surface on a real server and socket, with fake probes behind the Protocol.

Malformed and unauthorized requests get the right status and the daemon keeps serving.
"""

from __future__ import annotations

import os
import stat
import subprocess
import time

import grpc
import pytest

from stacklens.daemon import stacklens_pb2 as pb
from stacklens.daemon import stacklens_pb2_grpc as pbg
from stacklens.daemon.client import DaemonClient
from stacklens.daemon.session import ProcessSession
from stacklens.errors import AlreadyAttached, InputError, NoSuchProcess, PermissionDenied
from tests.fakes.sources import FakeEvent, FakeProbes, py

PROBES: dict[int, FakeProbes] = {}


def fake_session(pid, **kw):
    def probes(pid, **_):
        PROBES[pid] = FakeProbes(pid)
        return PROBES[pid]

    return ProcessSession(pid, probe_factory=probes, **kw)


@pytest.fixture
def session_factory():
    return fake_session


def test_socket_and_token_modes(daemon):
    sock = daemon.socket_path
    assert stat.S_IMODE(os.stat(sock).st_mode) & 0o007 == 0, "socket must not be world-accessible"
    tok = sock.parent / "token"
    assert stat.S_IMODE(os.stat(tok).st_mode) == 0o640
    assert stat.S_IMODE(os.stat(sock.parent).st_mode) == 0o750


def test_attach_snapshot_detach(daemon, target):
    with DaemonClient(str(daemon.socket_path)) as c:
        notes = c.attach(target)
        assert "fake probes attached" in notes
        PROBES[target].push(*[FakeEvent(kind="cpu_sample", py_stack=(py("main", 1), py("hot", 2)))] * 5)
        deadline = time.time() + 5
        while time.time() < deadline:
            snap = c.snapshot(target)
            if snap.total("cpu_samples") == 5:
                break
            time.sleep(0.05)
        assert snap.find(["py:train.py:main:1", "py:train.py:hot:2"]) is not None
        assert snap.total("cpu_samples") == 5
        assert any(p.pid == target and p.attached for p in c.processes())
        with pytest.raises(AlreadyAttached):
            c.attach(target)
        c.detach(target)
        assert PROBES[target].detached
        with pytest.raises(NoSuchProcess):
            c.detach(target)


def test_malformed_requests_are_refused_and_daemon_keeps_serving(daemon, target):
    with DaemonClient(str(daemon.socket_path)) as c:
        with pytest.raises(InputError):
            c.attach(-5)
        with pytest.raises(NoSuchProcess):
            c.attach(2**31 - 1)
        c.attach(target)
        with pytest.raises(InputError):
            c.snapshot_response(target, window_s=float("nan"))
        with pytest.raises(InputError):
            c.snapshot_response(target, window_s=-1.0)
        with pytest.raises(InputError):
            c.snapshot_response(target, metric="no_such_metric")
        with pytest.raises(NoSuchProcess):
            c.snapshot(12345678)
        # raw garbage bytes on the method: protobuf decode fails → INTERNAL/INVALID, server lives
        raw = c.channel.unary_unary("/stacklens.v1.Stacklens/GetSnapshot", request_serializer=None, response_deserializer=None)
        with pytest.raises(grpc.RpcError):
            raw(b"\xff\xff\xff\xff garbage", metadata=c._md, timeout=5)
        assert c.health().attached == 1


def test_unauthorized_calls_are_refused(daemon, target):
    ch = grpc.insecure_channel(f"unix:{daemon.socket_path}")
    stub = pbg.StacklensStub(ch)
    with pytest.raises(grpc.RpcError) as e:
        stub.Attach(pb.AttachRequest(pid=target), timeout=5)
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with pytest.raises(grpc.RpcError) as e:
        stub.Health(pb.HealthRequest(), timeout=5, metadata=(("authorization", "Bearer wrong"),))
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with pytest.raises(PermissionDenied):
        DaemonClient(str(daemon.socket_path), token="nope").health()
    ch.close()
    with DaemonClient(str(daemon.socket_path)) as c:
        assert c.health().version


def test_target_exit_closes_the_session(daemon):
    p = subprocess.Popen(["sleep", "60"])
    with DaemonClient(str(daemon.socket_path)) as c:
        c.attach(p.pid)
        p.kill()
        p.wait()
        deadline = time.time() + 5
        while time.time() < deadline and daemon.daemon.active():
            time.sleep(0.05)
        assert not daemon.daemon.active()
        assert c.snapshot_response(p.pid).state == "exited"
