"""The bytes of one agent connection cut into frames, with the size bounds of ``inject/agent/wire.py``.

No privilege, no I/O: bytes in, frames out. A frame is a 4-byte big-endian length and that many
bytes: a JSON message of at most ``wire.MAX_FRAME``, or a raw frame (``wire.RAW_MAGIC`` first;
CUPTI's activity buffers) of at most ``wire.MAX_RAW_FRAME``. A length beyond those is hostile or
broken, and a stream of frames cannot be resynchronised: ``FrameTooLarge``, and the connection
ends. Nothing is decoded here; the buffer never holds more than one frame's bound.
"""

from __future__ import annotations

from collections.abc import Iterator

from stacklens.inject.agent import wire


class FrameTooLarge(Exception):
    """A frame's announced length is over its kind's bound."""


class FrameBuffer:
    """The bytes received and not yet cut into frames."""

    def __init__(self) -> None:
        self._buf = bytearray()

    def feed(self, data: bytes) -> None:
        self._buf += data

    def frames(self) -> Iterator[bytes]:
        """The complete frames at the head of the buffer, each removed before it is yielded;
        raises FrameTooLarge at a length over its bound (seen as soon as the header is, for a
        raw frame once its magic is)."""
        buf = self._buf
        while len(buf) >= 4:
            n = int.from_bytes(buf[:4], "big")
            if n > wire.MAX_FRAME:
                # only a raw CUPTI frame may be bigger than a JSON one: look at its magic
                if n > wire.MAX_RAW_FRAME or (len(buf) >= 8 and buf[4:8] != wire.RAW_MAGIC):
                    raise FrameTooLarge(n)
            if len(buf) < 4 + n:
                return
            # one copy of the frame; both views released before buf is resized
            with memoryview(buf) as mv, mv[4:4 + n] as frame:
                raw = bytes(frame)
            del buf[:4 + n]
            yield raw

    def overfull(self) -> bool:
        """More bytes waiting than the largest frame can hold (a check behind ``frames``' own)."""
        return len(self._buf) > wire.MAX_RAW_FRAME + 4


def is_raw(frame: bytes) -> bool:
    """A raw frame (bytes, not JSON)."""
    return frame[:4] == wire.RAW_MAGIC


__all__ = ["FrameBuffer", "FrameTooLarge", "is_raw"]
