"""The standard gRPC services beside stacklens.v1.Stacklens: health and server reflection, bounded.

No privilege, no I/O. grpc.health.v1.Health: SERVING for "" and the stacklens service,
NOT_SERVING from the start of a stop; its Check and Watch need no token (``grpc_auth.OPEN_METHODS``:
kubelet's gRPC probe cannot send one), so Watch is bounded (at most ``max_watches`` streams, and
only the names this daemon serves) and holds no worker (grpc's non-blocking handler). Server
reflection, grpc.reflection.v1 (grpcurl, newer clients) and v1alpha (grpc_cli, older ones), behind
the token: it shows only the published schema, but its streams hold workers, at most
``max_reflection``, that a client without the token should not be able to take. grpcio-reflection
ships only v1alpha, so v1 is served by the same servicer (the two are wire-identical).
"""

from __future__ import annotations

import grpc

from stacklens.daemon import stacklens_pb2 as pb
from stacklens.daemon.grpc_calls import Busy, Slots, abort

REFLECTION_V1 = "grpc.reflection.v1.ServerReflection"


def add_standard_services(server: grpc.Server, *, max_watches: int, max_reflection: int):
    """Adds grpc.health.v1.Health and server reflection (v1 and v1alpha) to `server`; returns the
    health servicer, SERVING for "" and stacklens.v1.Stacklens until its `enter_graceful_shutdown()`.
    Reflection describes only what stacklens.proto already publishes, behind the TokenInterceptor
    like every other call; Health answers without the token (`OPEN_METHODS`)."""
    from grpc_health.v1 import health, health_pb2_grpc
    from grpc_reflection.v1alpha import reflection, reflection_pb2_grpc

    stacklens_name = pb.DESCRIPTOR.services_by_name["Stacklens"].full_name
    checker = _health_servicer((health.OVERALL_HEALTH, stacklens_name), max_watches)
    health_pb2_grpc.add_HealthServicer_to_server(checker, server)
    servicer = _reflection_servicer((stacklens_name, health.SERVICE_NAME, reflection.SERVICE_NAME, REFLECTION_V1),
                                    max_reflection)
    reflection_pb2_grpc.add_ServerReflectionServicer_to_server(servicer, server)
    server.add_generic_rpc_handlers((_reflection_v1_handler(servicer),))
    return checker


def _health_servicer(names, max_watches: int):
    """grpc's HealthServicer, SERVING for `names`. Watch is open to clients without the token, so it
    is bounded: at most `max_watches` streams, and a name this daemon does not serve gets
    SERVICE_UNKNOWN and the end of its stream (grpc's servicer would keep a set for every name a
    client sends, for ever; the daemon's services never change while it runs)."""
    from grpc_health.v1 import health, health_pb2

    known = frozenset(names)
    slots = Slots(max_watches, f"at most {max_watches} health Watch streams at once: use Check, or retry when "
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
                abort(context, e)
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


def _reflection_servicer(names, max_reflection: int):
    """grpcio-reflection's servicer (v1alpha messages) capped at `max_reflection` streams, which also
    describes grpc.reflection.v1 itself (`_reflection_v1_file`)."""
    from google.protobuf import descriptor_pool
    from grpc_reflection.v1alpha import reflection, reflection_pb2

    slots = Slots(max_reflection, f"at most {max_reflection} reflection streams at once: retry when a "
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
                abort(context, e)
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


__all__ = ["REFLECTION_V1", "add_standard_services"]
