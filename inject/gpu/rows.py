"""Daemon side of GPU activity rows sent as JSON (spec: ``inject/agent/wire.py`` and the collectors).

Rows are the one format both vendors' collectors can send: ``{"t": "kernel"|"api"|"memcpy"|"sync",
"r": [rows]}`` (kernel messages may name kernels by index into ``"n"``), times already
CLOCK_MONOTONIC ns. ROCm sends only these; CUPTI sends them when records go through cupti-python
(API records on, or no ctypes callbacks), and raw buffers otherwise (``inject/gpu/cupti.py``).
Hostile input: every field is type- and range-checked (``ProtocolError`` rejects the message).
No privilege, no I/O.
"""

from __future__ import annotations

from stacklens.inject.agent import wire
from stacklens.inject.records import ApiRecord, KernelRecord, MemcpyRecord, SyncRecord
from stacklens.inject.validate import ProtocolError
from stacklens.inject.validate import check_int as _int, check_list as _list, check_row as _row
from stacklens.inject.validate import check_text as _str

ROW_KINDS = ("kernel", "api", "memcpy", "sync")
MEMCPY_KINDS = wire.RAW_COPY_KINDS + ("memset", "other")
SYNC_TYPES = ("event", "stream", "context", "stream_wait_event", "other")
API_DOMAINS = ("runtime", "driver", "hip")


def parse_rows(t: str, msg: dict) -> list:
    """One rows message of kind ``t`` (one of ROW_KINDS) -> records."""
    if t == "kernel":
        out = []
        names = [_str(x) for x in _list(msg.get("n", []), 10_000)]  # rows may name a kernel by index
        for r in _list(msg.get("r")):
            name, s, e, dev, strm, corr, gx, gy, gz, bx, by, bz, graph = _row(r, 13)
            s, e = _int(s), _int(e)
            if e < s:
                raise ProtocolError("kernel ends before it starts")
            if type(name) is int:
                name = names[_int(name, 0, len(names) - 1)] if names else _str(name)
            out.append(KernelRecord(_str(name), s, e, _int(dev, 0, 1 << 16), _int(strm), _int(corr),
                                    (_int(gx), _int(gy), _int(gz)), (_int(bx), _int(by), _int(bz)), _int(graph)))
        return out
    if t == "api":
        out = []
        for r in _list(msg.get("r")):
            dom, name, tid, s, e, corr, cbid = _row(r, 7)
            if dom not in API_DOMAINS:
                raise ProtocolError("bad api domain")
            s, e = _int(s), _int(e)
            if e < s:
                raise ProtocolError("api call ends before it starts")
            out.append(ApiRecord(dom, _str(name, 256), _int(tid, 0, 1 << 31), s, e, _int(corr), _int(cbid, 0, 1 << 20)))
        return out
    if t == "memcpy":
        out = []
        for r in _list(msg.get("r")):
            kind, nbytes, s, e, dev, strm, corr = _row(r, 7)
            if kind not in MEMCPY_KINDS:
                raise ProtocolError("bad memcpy kind")
            s, e = _int(s), _int(e)
            if e < s:
                raise ProtocolError("memcpy ends before it starts")
            out.append(MemcpyRecord(kind, _int(nbytes), s, e, _int(dev, 0, 1 << 16), _int(strm), _int(corr)))
        return out
    if t == "sync":
        out = []
        for r in _list(msg.get("r")):
            typ, s, e, strm, corr = _row(r, 5)
            if typ not in SYNC_TYPES:
                raise ProtocolError("bad sync type")
            s, e = _int(s), _int(e)
            if e < s:
                raise ProtocolError("sync ends before it starts")
            out.append(SyncRecord(typ, s, e, _int(strm), _int(corr)))
        return out
    raise ProtocolError(f"not a rows message: {t!r}")
