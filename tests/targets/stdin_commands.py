"""stdin's lines for targets that wait for commands while Python keeps running between them.

A target blocked in a read of stdin never runs Python, so an agent cannot be injected into it
("did not run the bootstrap"); `commands()` waits in select with a short timeout instead.
"""

import os
import select
import sys


def commands():
    """stdin's lines, without their newline, until it closes."""
    buf = ""
    fd = sys.stdin.fileno()
    while True:
        if not select.select([fd], [], [], 0.05)[0]:
            continue
        chunk = os.read(fd, 4096).decode()
        if not chunk:
            return
        buf += chunk
        while "\n" in buf:
            line, buf = buf.split("\n", 1)
            yield line
