"""Frame format between the agent and the daemon: 4-byte big-endian length + UTF-8 JSON object.

Shared by both sides as constants only; the daemon validates every field it receives
(``stacklens.inject.server``) and never executes anything the target sends.
"""

import json
import struct

VERSION = 1
MAX_FRAME = 1 << 20          # bytes of one JSON message; bigger frames are a protocol error
MAX_STACK_DEPTH = 256
HEADER = struct.Struct(">I")


def encode(msg: dict) -> bytes:
    data = json.dumps(msg, separators=(",", ":"), ensure_ascii=False).encode("utf-8", "replace")
    return HEADER.pack(len(data)) + data
