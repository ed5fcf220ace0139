"""The real stacklensd serves server reflection and grpc.health.v1 beside stacklens.v1.Stacklens
(issue 22), over its Unix socket; reflection behind its token like every other call, health without
(issue 30: kubelet's gRPC probe cannot send one).

A reflection client lists the services and rebuilds the stacklens service from the daemon's
answers alone; Health/Check answers SERVING; a Watch stream sees NOT_SERVING once the daemon is
told to stop, and the daemon then exits 0. No BPF: nothing is attached.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
from google.protobuf import descriptor_pool
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from stacklens.daemon import stacklens_pb2 as pb
from stacklens.daemon.client import token_candidates

pytestmark = pytest.mark.integration
STACKLENS = "stacklens.v1.Stacklens"
HEALTH = "grpc.health.v1.Health"
REFLECTION = "grpc.reflection.v1alpha.ServerReflection"


class _Bearer(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
              grpc.StreamStreamClientInterceptor):
    """Adds the token to every call: generic clients (the reflection database) take no metadata."""

    def __init__(self, token: str) -> None:
        self._md = (("authorization", f"Bearer {token}"),)

    def _with_token(self, details):  # grpc hands interceptors a namedtuple
        return details._replace(metadata=tuple(details.metadata or ()) + self._md)

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(self._with_token(details), request)

    def intercept_unary_stream(self, continuation, details, request):
        return continuation(self._with_token(details), request)

    def intercept_stream_stream(self, continuation, details, request_iterator):
        return continuation(self._with_token(details), request_iterator)


@pytest.fixture
def stacklensd(tmp_path):
    sock = tmp_path / "run" / "s.sock"
    d = subprocess.Popen([sys.executable, "-m", "stacklens.daemon.server", "--socket", str(sock),
                          "--metrics-address", "off", "--log-level", "WARNING"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = d.stdout.readline()
        assert line.startswith("stacklensd: ready"), f"stacklensd did not start ({d.poll()}): {line!r} {d.stderr.read() if d.poll() is not None else ''}"
        token = next(c for c in token_candidates(sock) if c.exists()).read_text().strip()
        yield d, sock, token
    finally:
        if d.poll() is None:
            d.terminate()
        try:
            d.wait(timeout=10)
        except subprocess.TimeoutExpired:
            d.kill()
            d.wait()
        for f in (d.stdout, d.stderr):
            f.close()


def _channel(sock: Path, token: str | None) -> grpc.Channel:
    ch = grpc.insecure_channel(f"unix:{sock}")
    return ch if token is None else grpc.intercept_channel(ch, _Bearer(token))


def _list_services(ch: grpc.Channel) -> list[str]:
    stub = reflection_pb2_grpc.ServerReflectionStub(ch)
    (resp,) = list(stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]),
                                             timeout=10))
    return sorted(s.name for s in resp.list_services_response.service)


def test_reflection_lists_and_describes_the_stacklens_service(stacklensd):
    _, sock, token = stacklensd
    ch = _channel(sock, token)
    assert _list_services(ch) == sorted([STACKLENS, HEALTH, REFLECTION, "grpc.reflection.v1.ServerReflection"])
    # grpcio-reflection's own client: the service and its messages rebuilt from the daemon's answers
    pool = descriptor_pool.DescriptorPool(ProtoReflectionDescriptorDatabase(ch))
    svc = pool.FindServiceByName(STACKLENS)
    want = pb.DESCRIPTOR.services_by_name["Stacklens"]
    assert {m.name for m in svc.methods} == {m.name for m in want.methods}
    assert svc.methods_by_name["StreamSnapshots"].output_type.full_name == "stacklens.v1.SnapshotResponse"
    attach = pool.FindMessageTypeByName("stacklens.v1.AttachRequest")
    assert [f.name for f in attach.fields] == [f.name for f in pb.AttachRequest.DESCRIPTOR.fields]
    ch.close()


def test_health_check_is_serving(stacklensd):
    _, sock, token = stacklensd
    ch = _channel(sock, token)
    stub = health_pb2_grpc.HealthStub(ch)
    for name in ("", STACKLENS):
        r = stub.Check(health_pb2.HealthCheckRequest(service=name), timeout=10)
        assert r.status == health_pb2.HealthCheckResponse.SERVING, name
    with pytest.raises(grpc.RpcError) as e:
        stub.Check(health_pb2.HealthCheckRequest(service="no.such.Service"), timeout=10)
    assert e.value.code() == grpc.StatusCode.NOT_FOUND
    ch.close()


def test_without_the_token_health_answers_and_reflection_is_refused(stacklensd):
    _, sock, _ = stacklensd
    ch = _channel(sock, None)
    health = health_pb2_grpc.HealthStub(ch)
    assert health.Check(health_pb2.HealthCheckRequest(), timeout=10).status == health_pb2.HealthCheckResponse.SERVING
    watch = health.Watch(health_pb2.HealthCheckRequest(), timeout=10)
    assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
    watch.cancel()
    with pytest.raises(grpc.RpcError) as e:
        _list_services(ch)
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    ch.close()


def test_reflection_streams_are_capped(stacklensd):
    _, sock, token = stacklensd
    from stacklens.daemon.grpc_service import MAX_REFLECTION

    ch = _channel(sock, token)
    stub = reflection_pb2_grpc.ServerReflectionStub(ch)
    held = []
    ask = reflection_pb2.ServerReflectionRequest(list_services="")
    for _ in range(MAX_REFLECTION):
        # a generator that asks once and then keeps the stream open, as a slow client does
        def requests():
            yield ask
            time.sleep(30)

        call = stub.ServerReflectionInfo(requests(), timeout=30)
        assert next(call).list_services_response.service  # the stream has its slot
        held.append(call)
    with pytest.raises(grpc.RpcError) as e:
        _list_services(ch)
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "reflection streams" in e.value.details()
    held.pop().cancel()
    deadline = time.monotonic() + 60   # a bound for a busy machine; the loop ends at the first success
    while True:  # the slot comes back once the server sees the cancellation
        try:
            assert STACKLENS in _list_services(ch)
            break
        except grpc.RpcError as err:
            assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and time.monotonic() < deadline
            time.sleep(0.05)
    for call in held:
        call.cancel()
    ch.close()


def test_a_stopping_daemon_reports_not_serving_then_exits(stacklensd):
    d, sock, token = stacklensd
    ch = _channel(sock, token)
    watch = health_pb2_grpc.HealthStub(ch).Watch(health_pb2.HealthCheckRequest(service=STACKLENS), timeout=30)
    assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
    d.send_signal(signal.SIGTERM)
    seen = []
    try:
        for r in watch:
            seen.append(r.status)
    except grpc.RpcError as e:  # the stream itself ends when the server stops
        assert e.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED), e
    assert seen == [health_pb2.HealthCheckResponse.NOT_SERVING]
    assert d.wait(timeout=15) == 0
    ch.close()
