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

_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f]")


def _escape(m: re.Match) -> str:
    return f"\\x{ord(m.group()):02x}"


def safe_text(s: str) -> str:
    """``s`` with every C0/DEL/C1 control character written as ``\\xNN`` (``s`` itself if none)."""
    if _CONTROL.search(s) is None:
        return s
    return _CONTROL.sub(_escape, s)


__all__ = ["safe_text"]
