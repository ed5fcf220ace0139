"""Who may call stacklensd over gRPC: the daemon's bearer token on every call but health's.

No privilege, no I/O. The Unix socket is mode 0660 (root + group `stacklens`); every call must also
carry the daemon's token (`authorization: Bearer …`, read from the root:stacklens 0640 token file
beside the socket), so a connection that gets past the file mode — or a TCP client — still needs
it. Compared in constant time. Health's Check and Watch are open (`OPEN_METHODS`).
"""

from __future__ import annotations

import hmac

import grpc

# Health/Check and Health/Watch need no token: kubelet's gRPC probe and grpc_health_probe cannot
# send one, and the answer (SERVING or not) reveals nothing. Exact paths: grpc matches them so.
OPEN_METHODS = frozenset({"/grpc.health.v1.Health/Check", "/grpc.health.v1.Health/Watch"})


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


__all__ = ["OPEN_METHODS", "TokenInterceptor"]
