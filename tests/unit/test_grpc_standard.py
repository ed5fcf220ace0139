"""stacklensd's standard services on a real gRPC server and socket (issue 30.6), fake probes behind
the Protocol:

- a client with no token (kubelet's gRPC probe, grpc_health_probe) gets SERVING from Health/Check
  and as Watch's first message; a Watch of a service the daemon does not have gets SERVICE_UNKNOWN
  and its end; Watch streams are capped;
- without the token every Stacklens RPC and reflection (v1 and v1alpha) are still refused;
- a reflection v1 client, built here from the fields of grpc's reflection/v1/reflection.proto
  (not from v1alpha's), lists the Stacklens service and gets a v1 descriptor with the same fields.
"""

from __future__ import annotations

import time

import grpc
import pytest
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from stacklens.daemon import grpc_service
from stacklens.daemon import stacklens_pb2 as pb
from stacklens.daemon.client import DaemonClient
from tests.grpc_daemon import serving

STACKLENS = "stacklens.v1.Stacklens"
HEALTH = "grpc.health.v1.Health"
V1 = "grpc.reflection.v1.ServerReflection"
V1ALPHA = "grpc.reflection.v1alpha.ServerReflection"
SERVING = health_pb2.HealthCheckResponse.SERVING


@pytest.fixture
def bare(daemon):
    """A channel that sends no token, as kubelet's probe does."""
    ch = grpc.insecure_channel(f"unix:{daemon.socket_path}")
    yield ch
    ch.close()


def _token(daemon) -> tuple[tuple[str, str]]:
    return (("authorization", f"Bearer {daemon.token_path.read_text().strip()}"),)


def test_health_answers_a_client_without_the_token(bare):
    stub = health_pb2_grpc.HealthStub(bare)
    for name in ("", STACKLENS):
        assert stub.Check(health_pb2.HealthCheckRequest(service=name), timeout=10).status == SERVING, name
        watch = stub.Watch(health_pb2.HealthCheckRequest(service=name), timeout=10)
        assert next(watch).status == SERVING, name
        watch.cancel()
    with pytest.raises(grpc.RpcError) as e:
        stub.Check(health_pb2.HealthCheckRequest(service="no.such.Service"), timeout=10)
    assert e.value.code() == grpc.StatusCode.NOT_FOUND


def test_a_watch_of_an_unknown_service_ends_with_service_unknown(bare):
    watch = health_pb2_grpc.HealthStub(bare).Watch(health_pb2.HealthCheckRequest(service="x" * 1000), timeout=10)
    assert [r.status for r in watch] == [health_pb2.HealthCheckResponse.SERVICE_UNKNOWN]
    assert watch.code() == grpc.StatusCode.OK


def _raw_call(ch: grpc.Channel, path: str, method) -> None:
    """Calls `path` with an empty request of the method's own kind (bytes in, bytes out)."""
    kind = (method.client_streaming, method.server_streaming)
    if kind == (False, False):
        ch.unary_unary(path)(b"", timeout=10)
    elif kind == (False, True):
        list(ch.unary_stream(path)(b"", timeout=10))
    elif kind == (True, True):
        list(ch.stream_stream(path)(iter([b""]), timeout=10))
    else:
        ch.stream_unary(path)(iter([b""]), timeout=10)


def test_without_the_token_every_other_call_is_refused(daemon, bare):
    methods = [(f"/{STACKLENS}/{m.name}", m) for m in pb.DESCRIPTOR.services_by_name["Stacklens"].methods]
    info = reflection_pb2.DESCRIPTOR.services_by_name["ServerReflection"].methods_by_name["ServerReflectionInfo"]
    methods += [(f"/{svc}/ServerReflectionInfo", info) for svc in (V1, V1ALPHA)]
    methods.append(("/stacklens.v1.Stacklens/NoSuchMethod", info))
    assert len(methods) > 5
    for path, method in methods:
        with pytest.raises(grpc.RpcError) as e:
            _raw_call(bare, path, method)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED, path
    with pytest.raises(grpc.RpcError) as e:   # a wrong token is no token
        bare.unary_unary(f"/{STACKLENS}/Health")(b"", timeout=10, metadata=(("authorization", "Bearer nope"),))
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with DaemonClient(str(daemon.socket_path), timeout=10) as c:   # the token file still opens them
        assert c.health().version
        assert c.processes() is not None


def test_watch_streams_are_capped_and_given_back(tmp_path, monkeypatch):
    monkeypatch.setattr(grpc_service, "MAX_WATCHES", 2)
    with serving(tmp_path) as d:
        ch = grpc.insecure_channel(f"unix:{d.socket_path}")
        try:
            stub = health_pb2_grpc.HealthStub(ch)
            held = [stub.Watch(health_pb2.HealthCheckRequest(), timeout=30) for _ in range(2)]
            assert [next(w).status for w in held] == [SERVING, SERVING]
            with pytest.raises(grpc.RpcError) as e:
                next(stub.Watch(health_pb2.HealthCheckRequest(), timeout=10))
            assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "Watch streams" in e.value.details()
            assert stub.Check(health_pb2.HealthCheckRequest(), timeout=10).status == SERVING  # Check is not capped
            held.pop().cancel()
            deadline = time.monotonic() + 30   # a bound; the loop ends once the server has seen the cancel
            while True:
                try:
                    w = stub.Watch(health_pb2.HealthCheckRequest(), timeout=10)
                    assert next(w).status == SERVING
                    w.cancel()
                    break
                except grpc.RpcError as err:
                    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and time.monotonic() < deadline
                    time.sleep(0.02)
            for w in held:
                w.cancel()
        finally:
            ch.close()


# grpc/reflection/v1/reflection.proto's messages, field by field: (name, number, type, message type,
# repeated, in the oneof). Written from that file, not derived from v1alpha, so that the test
# checks the claim that the two are wire-identical.
_S, _I, _B, _M = (descriptor_pb2.FieldDescriptorProto.TYPE_STRING, descriptor_pb2.FieldDescriptorProto.TYPE_INT32,
                  descriptor_pb2.FieldDescriptorProto.TYPE_BYTES, descriptor_pb2.FieldDescriptorProto.TYPE_MESSAGE)
V1_MESSAGES = {
    "ServerReflectionRequest": [
        ("host", 1, _S, "", False, False), ("file_by_filename", 3, _S, "", False, True),
        ("file_containing_symbol", 4, _S, "", False, True),
        ("file_containing_extension", 5, _M, "ExtensionRequest", False, True),
        ("all_extension_numbers_of_type", 6, _S, "", False, True), ("list_services", 7, _S, "", False, True)],
    "ExtensionRequest": [("containing_type", 1, _S, "", False, False), ("extension_number", 2, _I, "", False, False)],
    "ServerReflectionResponse": [
        ("valid_host", 1, _S, "", False, False), ("original_request", 2, _M, "ServerReflectionRequest", False, False),
        ("file_descriptor_response", 4, _M, "FileDescriptorResponse", False, True),
        ("all_extension_numbers_response", 5, _M, "ExtensionNumberResponse", False, True),
        ("list_services_response", 6, _M, "ListServiceResponse", False, True),
        ("error_response", 7, _M, "ErrorResponse", False, True)],
    "FileDescriptorResponse": [("file_descriptor_proto", 1, _B, "", True, False)],
    "ExtensionNumberResponse": [("base_type_name", 1, _S, "", False, False),
                                ("extension_number", 2, _I, "", True, False)],
    "ListServiceResponse": [("service", 1, _M, "ServiceResponse", True, False)],
    "ServiceResponse": [("name", 1, _S, "", False, False)],
    "ErrorResponse": [("error_code", 1, _I, "", False, False), ("error_message", 2, _S, "", False, False)],
}
ONEOF = {"ServerReflectionRequest": "message_request", "ServerReflectionResponse": "message_response"}


def _v1_file() -> descriptor_pb2.FileDescriptorProto:
    fd = descriptor_pb2.FileDescriptorProto(name="test/reflection_v1.proto", package="grpc.reflection.v1",
                                            syntax="proto3")
    for name, fields in V1_MESSAGES.items():
        m = fd.message_type.add(name=name)
        if name in ONEOF:
            m.oneof_decl.add(name=ONEOF[name])
        for fname, number, typ, msg, repeated, in_oneof in fields:
            f = m.field.add(name=fname, number=number, type=typ, json_name=_camel(fname),
                            label=descriptor_pb2.FieldDescriptorProto.LABEL_REPEATED if repeated
                            else descriptor_pb2.FieldDescriptorProto.LABEL_OPTIONAL)
            if msg:
                f.type_name = f".grpc.reflection.v1.{msg}"
            if in_oneof:
                f.oneof_index = 0
    return fd


def _camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(p.title() for p in rest)


def _shape(fd: descriptor_pb2.FileDescriptorProto) -> dict:
    """What decides the bytes on the wire: each message's fields and which of them share the oneof."""
    return {m.name: sorted((f.name, f.number, f.type, f.label, f.type_name, f.HasField("oneof_index"))
                           for f in m.field) for m in fd.message_type}


@pytest.fixture
def v1_client(daemon):
    pool = descriptor_pool.DescriptorPool()
    pool.AddSerializedFile(_v1_file().SerializeToString())
    req = message_factory.GetMessageClass(pool.FindMessageTypeByName("grpc.reflection.v1.ServerReflectionRequest"))
    resp = message_factory.GetMessageClass(pool.FindMessageTypeByName("grpc.reflection.v1.ServerReflectionResponse"))
    ch = grpc.insecure_channel(f"unix:{daemon.socket_path}")
    call = ch.stream_stream(f"/{V1}/ServerReflectionInfo", request_serializer=req.SerializeToString,
                            response_deserializer=resp.FromString)

    def ask(**field):
        return list(call(iter([req(**field)]), timeout=10, metadata=_token(daemon)))

    yield ask
    ch.close()


def test_a_reflection_v1_client_lists_and_describes_the_services(v1_client):
    (listed,) = v1_client(list_services="")
    assert listed.WhichOneof("message_response") == "list_services_response"
    assert sorted(s.name for s in listed.list_services_response.service) == sorted([STACKLENS, HEALTH, V1, V1ALPHA])

    (described,) = v1_client(file_containing_symbol=STACKLENS)
    files = [descriptor_pb2.FileDescriptorProto.FromString(b)
             for b in described.file_descriptor_response.file_descriptor_proto]
    svc = next(s for f in files for s in f.service if f"{f.package}.{s.name}" == STACKLENS)
    assert {m.name for m in svc.method} == {m.name for m in pb.DESCRIPTOR.services_by_name["Stacklens"].methods}

    # v1 describes itself: the same messages, fields and numbers as grpc's v1 reflection.proto
    (own,) = v1_client(file_containing_symbol=V1)
    (served,) = [descriptor_pb2.FileDescriptorProto.FromString(b)
                 for b in own.file_descriptor_response.file_descriptor_proto]
    assert served.package == "grpc.reflection.v1"
    assert [s.name for s in served.service] == ["ServerReflection"]
    assert _shape(served) == _shape(_v1_file())
    (by_name,) = v1_client(file_by_filename=served.name)
    assert by_name.file_descriptor_response.file_descriptor_proto == own.file_descriptor_response.file_descriptor_proto

    (missing,) = v1_client(file_containing_symbol="no.such.Symbol")
    assert missing.error_response.error_code == grpc.StatusCode.NOT_FOUND.value[0]


def test_v1alpha_reflection_still_answers(daemon):
    ch = grpc.insecure_channel(f"unix:{daemon.socket_path}")
    try:
        stub = reflection_pb2_grpc.ServerReflectionStub(ch)
        (r,) = list(stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]),
                                              timeout=10, metadata=_token(daemon)))
        assert STACKLENS in {s.name for s in r.list_services_response.service}
    finally:
        ch.close()
