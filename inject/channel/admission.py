"""Who the agent server talks to: the target's own process, then only after a hello with the token.

Two gates, both before anything the peer sends is decoded. A connection is served only when its
peer's SO_PEERCRED pid is the target (any process able to reach the socket, even of the target's
group, is refused and counted ``rejected_peer``). Its first frame must be a hello of the wire's
version carrying the server's token (handed to the agent by its bootstrap); its fields are checked
like any hostile input. No I/O but one getsockopt.
"""

from __future__ import annotations

import socket
import struct

from stacklens.inject.agent import wire
from stacklens.inject.channel.validate import ProtocolError
from stacklens.inject.channel.validate import check_int as _int, check_row as _row, check_text as _str
from stacklens.records.agent import AgentHello


def peer_pid(conn: socket.socket) -> int:
    """The connecting process's pid by SO_PEERCRED (the kernel's word, not the peer's); -1 when
    it cannot be read."""
    try:
        cred = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        peer, _uid, _gid = struct.unpack("3i", cred)
    except OSError:
        return -1
    return peer


def check_hello(msg, token: str) -> AgentHello:
    """The agent's hello from its first message; raises ProtocolError (or TypeError) when that is
    not a hello of this wire version with ``token``, or a field is out of range."""
    if type(msg) is not dict or msg.get("t") != "hello" or msg.get("v") != wire.VERSION:
        raise ProtocolError("first message is not a hello")
    if msg.get("token") != token:
        raise ProtocolError("bad token")
    py = _row(msg.get("python"), 3)
    return AgentHello(_int(msg.get("pid"), 1, 1 << 31), _int(msg.get("tid"), 0, 1 << 31),
                      (_int(py[0], 0, 99), _int(py[1], 0, 99), _int(py[2], 0, 99)),
                      _str(msg.get("executable", ""), 4096))


__all__ = ["check_hello", "peer_pid"]
