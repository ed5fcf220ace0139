"""Daemon side of GPU activity rows sent as JSON (spec: ``inject/agent/wire.py`` and the collectors).

Rows are the one format both vendors' collectors can send: ``{"t": "kernel"|"api"|"memcpy"|"sync",
"r": [rows]}`` (kernel messages may name kernels by index into ``"n"``), times already
CLOCK_MONOTONIC ns. ROCm sends only these; CUPTI sends them when records go through cupti-python
(API records on, or no ctypes callbacks), and raw buffers otherwise (``inject/channel/gpu/cupti.py``).
Hostile input: every field is type- and range-checked (``ProtocolError`` rejects the message).
No privilege, no I/O.
"""

from __future__ import annotations

from stacklens.inject.agent import wire
from stacklens.records.agent import ApiRecord, KernelRecord, MemcpyRecord, SyncRecord
from stacklens.inject.channel.validate import ProtocolError
from stacklens.inject.channel.validate import check_int as _int, check_list as _list, check_row as _row
from stacklens.inject.channel.validate import check_text as _str

ROW_KINDS = ("kernel", "api", "memcpy", "sync")
MEMCPY_KINDS = wire.RAW_COPY_KINDS + ("memset", "other")
SYNC_TYPES = ("event", "stream", "context", "stream_wait_event", "other")
API_DOMAINS = ("runtime", "driver", "hip")


def _interval(s, e, what: str) -> tuple[int, int]:
    s, e = _int(s), _int(e)
    if e < s:
        raise ProtocolError(f"{what} ends before it starts")
    return s, e


def _choice(value, allowed: tuple[str, ...], what: str) -> str:
    if value not in allowed:
        raise ProtocolError(f"bad {what}")
    return value


def _kernel(r, names: list[str]) -> KernelRecord:
    # 14 fields since the graph node id travels; an agent of 13 sends none (0)
    name, s, e, dev, strm, corr, gx, gy, gz, bx, by, bz, graph, *node = _row(r, 14 if type(r) is list and len(r) == 14
                                                                         else 13)
    if type(name) is int:
        name = names[_int(name, 0, len(names) - 1)] if names else _str(name)
    return KernelRecord(_str(name), *_interval(s, e, "kernel"), _int(dev, 0, 1 << 16), _int(strm), _int(corr),
                        (_int(gx), _int(gy), _int(gz)), (_int(bx), _int(by), _int(bz)), _int(graph),
                        _int(node[0]) if node else 0)


def _api(r) -> ApiRecord:
    dom, name, tid, s, e, corr, cbid = _row(r, 7)
    return ApiRecord(_choice(dom, API_DOMAINS, "api domain"), _str(name, 256), _int(tid, 0, 1 << 31),
                     *_interval(s, e, "api call"), _int(corr), _int(cbid, 0, 1 << 20))


def _memcpy(r) -> MemcpyRecord:
    kind, nbytes, s, e, dev, strm, corr = _row(r, 7)
    return MemcpyRecord(_choice(kind, MEMCPY_KINDS, "memcpy kind"), _int(nbytes), *_interval(s, e, "memcpy"),
                        _int(dev, 0, 1 << 16), _int(strm), _int(corr))


def _sync(r) -> SyncRecord:
    typ, s, e, strm, corr = _row(r, 5)
    return SyncRecord(_choice(typ, SYNC_TYPES, "sync type"), *_interval(s, e, "sync"), _int(strm), _int(corr))


def parse_rows(t: str, msg: dict) -> list:
    """One rows message of kind ``t`` (one of ROW_KINDS) -> records."""
    if t == "kernel":
        names = [_str(x) for x in _list(msg.get("n", []), 10_000)]  # rows may name a kernel by index
        return [_kernel(r, names) for r in _list(msg.get("r"))]
    parse = _PARSERS.get(t)
    if parse is None:
        raise ProtocolError(f"not a rows message: {t!r}")
    return [parse(r) for r in _list(msg.get("r"))]


_PARSERS = {"api": _api, "memcpy": _memcpy, "sync": _sync}
