"""Strings a target controls, made safe to print: control characters escaped as ``\\xNN``.

No privilege, no I/O. A process names itself (``comm``, ``prctl(PR_SET_NAME)``) and its code
(``co_name``, ``co_filename``, ELF symbols) as it likes; printed raw, an ESC starts an ANSI/OSC
sequence in the terminal of whoever runs ``stacklens ps`` or reads a report (clear the screen,
set the title, OSC 52 clipboard writes). ``safe_text`` is applied where such a string enters
stacklens (``/proc/PID/comm``, code objects read from the target, agent records), so every
view and metric label downstream gets the escaped form.

Escaped: C0 (U+0000-U+001F, tab and newline included: one label, one line), DEL (U+007F) and C1
(U+0080-U+009F: 8-bit CSI/OSC on terminals that take them). Everything else is kept as it is.
Cost: one regex scan (C speed) of a string without control characters, nothing else.
"""

from __future__ import annotations

import re

from stacklens.errors import ProtocolError

_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f]")


def _escape(m: re.Match) -> str:
    return f"\\x{ord(m.group()):02x}"


def safe_text(s: str) -> str:
    """``s`` with every C0/DEL/C1 control character written as ``\\xNN`` (``s`` itself if none)."""
    if _CONTROL.search(s) is None:
        return s
    return _CONTROL.sub(_escape, s)


__all__ = ["safe_text", "clip_text", "MAX_FRAME_FILE", "MAX_FRAME_NAME"]


# A frame's file and function name: longer ones are cut, not refused. Every frame string stays in
# the session's tree (all window buckets), so their length is what a hostile agent would grow the
# daemon by (issue 17: unique 8 KiB strings took it from 295 MiB to 5.4 GiB in 74 s). PATH_MAX
# paths and C++-template qualnames of real code fit.
MAX_FRAME_FILE = 1024
MAX_FRAME_NAME = 512


def clip_text(v, maxlen: int, what: str = "bad string", counts=None) -> str:
    """A string (anything else raises) cut in the middle to ``maxlen`` characters (``…`` marks
    the cut: the start names the package, the end the file or method) and escaped like
    ``check_text``. ``counts["truncated_strings"]`` (a Counter, if given) counts the cuts."""
    if type(v) is not str:
        raise ProtocolError(what)
    if len(v) > maxlen:
        v = v[:maxlen // 2] + "…" + v[len(v) - (maxlen - maxlen // 2 - 1):]
        if counts is not None:
            counts["truncated_strings"] += 1
    v = safe_text(v)
    if len(v) > maxlen:                 # escapes made it longer: cut again, the end goes
        v = v[:maxlen - 1] + "…"
    return v
