"""Strict checks of what the agent sends (hostile input), shared by ``messages.py`` (JSON messages)
and ``gpu/`` (GPU rows, raw CUPTI layout and headers).

Each ``check_*`` returns its value unchanged or raises ``ProtocolError`` (``what`` is the message);
``check_text`` and ``clip_text`` return strings made safe to print (control characters escaped,
``textsafe.py``), ``clip_text`` also cut to a length instead of refusing them.
Types are exact (``type(v) is int``: a bool is not an integer here). No imports from the rest of
the channel, so that every module of it can import this one without a cycle.
"""

from __future__ import annotations

from stacklens.errors import ProtocolError
from stacklens.textsafe import MAX_FRAME_FILE, MAX_FRAME_NAME, clip_text, safe_text  # noqa: F401 — re-used here

MAX_STR = 8192
MAX_INT = (1 << 63) - 1
MAX_BATCH = 20000


def check_int(v, lo=0, hi=MAX_INT, what: str | None = None) -> int:
    if type(v) is not int or not lo <= v <= hi:
        raise ProtocolError(what or f"bad integer {v!r}")
    return v


def check_str(v, maxlen=MAX_STR, what: str = "bad string") -> str:
    if type(v) is not str or len(v) > maxlen:
        raise ProtocolError(what)
    return v


def check_text(v, maxlen=MAX_STR, what: str = "bad string") -> str:
    """``check_str``, then control characters escaped (``textsafe.safe_text``)."""
    return safe_text(check_str(v, maxlen, what))


def check_num(v, what: str = "bad number") -> float:
    """A finite-ish number (int or float, not NaN, |v| <= 1e18) as a float."""
    if type(v) not in (int, float) or v != v or abs(v) > 1e18:
        raise ProtocolError(what)
    return float(v)


def check_list(v, maxlen=MAX_BATCH, what: str = "bad list") -> list:
    if type(v) is not list or len(v) > maxlen:
        raise ProtocolError(what)
    return v


def check_row(v, n: int, what: str = "bad row") -> list:
    if type(v) is not list or len(v) != n:
        raise ProtocolError(what)
    return v


def check_dict(v, maxlen: int, what: str = "bad object", minlen: int = 0) -> dict:
    if type(v) is not dict or not minlen <= len(v) <= maxlen:
        raise ProtocolError(what)
    return v


def check_choice(v, choices, what: str, typ: type = str):
    """``v`` of exactly type ``typ`` and one of ``choices`` (the type check first, so an
    unhashable value never reaches a dict/set ``in``)."""
    if type(v) is not typ or v not in choices:
        raise ProtocolError(what)
    return v


def check_message(msg, t: str, what: str) -> dict:
    """A decoded JSON message: an object whose ``"t"`` is ``t``."""
    if type(msg) is not dict or msg.get("t") != t:
        raise ProtocolError(what)
    return msg


__all__ = ["ProtocolError", "MAX_STR", "MAX_INT", "MAX_BATCH", "MAX_FRAME_FILE", "MAX_FRAME_NAME", "check_int",
           "check_str", "check_text", "clip_text", "check_num",
           "check_list", "check_row", "check_dict", "check_choice", "check_message"]
