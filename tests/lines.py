"""Lines from a child's pipe with a timeout, read from its fd.

select() then a buffered readline() can hang: readline() may take two lines from the pipe and
return one, leaving the other in the file object's buffer, where select() does not see it; a
child that then goes quiet (a profile window for its whole length) leaves the test waiting on a
line it already has. Here every read goes through one buffer per stream."""

from __future__ import annotations

import os
import select
import time
import weakref

_buffers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def read_line(stream, timeout: float) -> str | None:
    """The stream's next line with its newline; None at its end; TimeoutError after `timeout` s."""
    buf = _buffers.get(stream, b"")
    fd = stream.fileno()
    deadline = time.monotonic() + timeout
    try:
        while b"\n" not in buf:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise TimeoutError(f"no line within {timeout:g}s")
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                line, buf = buf, b""
                return line.decode(errors="replace") or None
            buf += chunk
        line, buf = buf.split(b"\n", 1)
        return line.decode(errors="replace") + "\n"
    finally:
        _buffers[stream] = buf


def rest(stream) -> str:
    """What was read from the stream past the lines returned (to put before a later read())."""
    return _buffers.pop(stream, b"").decode(errors="replace")
