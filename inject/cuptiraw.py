"""Daemon side of raw CUPTI activity buffers (spec: top of ``inject/agent/wire.py``).

The agent ships each completed CUPTI buffer as bytes plus, once, a ``cupti_layout`` message that
says where each field sits in each record kind. Everything here is hostile input: the layout and
every header are validated strictly (``ProtocolError``), every read is bounds-checked, and one
record with out-of-range values is skipped and counted, never fatal. Kernel names are pointers into
the target's memory, read from ``/proc/PID/mem`` by ``NameReader`` (cached, never raising).

No imports from ``server.py`` (it imports this module): ``ProtocolError`` / ``MAX_STR`` /
``MAX_INT`` live here and ``server`` re-exports them.
"""

from __future__ import annotations

import operator
import os
import struct
import threading

from .agent import wire
from .records import KernelRecord, MemcpyRecord

MAX_STR = 8192
MAX_INT = (1 << 63) - 1
MAX_DEVICE = 1 << 16
MAX_KINDS = 16
MAX_FIELDS = 40
MAX_OFFS = 200_000
MAX_KIND_CODE = 1000
ALIGNS = (1, 2, 4, 8, 16)
COPY_KINDS = wire.RAW_COPY_KINDS
# required fields per record type (the first is always "kind"), in the order parse_raw reads them
FIELDS = wire.RAW_FIELDS
OPTIONAL = wire.RAW_OPTIONAL_FIELDS
_U32 = struct.Struct("<I")


class ProtocolError(ValueError):
    pass


class KindLayout:
    """One record kind: its type, size and a reader ``read(buf, off) -> tuple`` of the FIELDS
    (without "kind"; kernels get graph_id appended, 0 when the layout has none)."""
    __slots__ = ("code", "rec", "size", "fields", "read")

    def __init__(self, code: int, rec: str, size: int, fields: dict) -> None:
        self.code, self.rec, self.size, self.fields = code, rec, size, fields
        want = FIELDS[rec][1:] + tuple(f for f in OPTIONAL[rec] if f in fields)
        self.read = _reader([(f, *fields[f]) for f in want], pad_zero=rec == "kernel" and "graph_id" not in fields)


def _reader(spec, pad_zero: bool):
    """Precompiled reader of (name, offset, fmt) fields: few struct.Structs over non-overlapping
    runs (pad bytes between fields), then one itemgetter into the wanted order."""
    order = sorted(range(len(spec)), key=lambda i: spec[i][1])
    groups = []                     # [(fmt string, end, [spec indices])]
    for i in order:
        _, off, fmt = spec[i]
        for g in groups:
            if g[1] <= off:
                g[0].append(f"{off - g[1]}x{fmt}" if off > g[1] else fmt)
                g[1] = off + struct.calcsize("<" + fmt)
                g[2].append(i)
                break
        else:
            groups.append([[f"{off}x{fmt}" if off else fmt], off + struct.calcsize("<" + fmt), [i]])
    structs = [struct.Struct("<" + "".join(g[0])).unpack_from for g in groups]
    pos = [0] * len(spec)           # spec index -> position in the concatenated unpacked tuple
    k = 0
    for g in groups:
        for i in g[2]:
            pos[i] = k
            k += 1
    if pad_zero:
        pos.append(k)               # graph_id absent: a constant 0 after the unpacked values
    get = operator.itemgetter(*pos)
    if len(structs) == 1 and not pad_zero:
        u = structs[0]
        if pos == list(range(len(pos))):
            return u
        return lambda buf, off: get(u(buf, off))
    if len(structs) == 1:
        u = structs[0]
        return lambda buf, off: get(u(buf, off) + (0,))
    tail = (0,) if pad_zero else ()

    def read(buf, off):
        t = ()
        for u in structs:
            t += u(buf, off)
        return get(t + tail)
    return read


class Layout:
    __slots__ = ("kinds", "copy_kinds")

    def __init__(self, kinds: dict, copy_kinds: dict) -> None:
        self.kinds: dict[int, KindLayout] = kinds
        self.copy_kinds: dict[int, str] = copy_kinds


def _code(k) -> int:
    """A kind code: JSON object keys arrive as strings ("10"); plain decimal only."""
    if type(k) is str and k.isascii() and k.isdigit() and len(k) <= 4:
        k = int(k)
    if type(k) is not int or not 0 <= k <= MAX_KIND_CODE:
        raise ProtocolError(f"bad kind code {str(k)[:16]!r}")
    return k


def parse_layout(msg) -> Layout:
    """A ``cupti_layout`` message -> Layout. Raises ProtocolError on anything unexpected."""
    if type(msg) is not dict or msg.get("t") != "cupti_layout":
        raise ProtocolError("not a cupti_layout message")
    kinds_in = msg.get("kinds")
    if type(kinds_in) is not dict or not 0 < len(kinds_in) <= MAX_KINDS:
        raise ProtocolError("bad layout kinds")
    kinds = {}
    for k, v in kinds_in.items():
        code = _code(k)
        if code in kinds:
            raise ProtocolError("duplicate kind code")
        if type(v) is not dict:
            raise ProtocolError("bad kind layout")
        rec = v.get("rec")
        if type(rec) is not str or rec not in FIELDS:
            raise ProtocolError("bad record type")
        size = v.get("size")
        if type(size) is not int or not 8 <= size <= 4096:
            raise ProtocolError("bad record size")
        fields_in = v.get("fields")
        if type(fields_in) is not dict or len(fields_in) > MAX_FIELDS:
            raise ProtocolError("bad fields")
        fields = {}
        for name, f in fields_in.items():
            if type(name) is not str or len(name) > 64:
                raise ProtocolError("bad field name")
            if type(f) is not list or len(f) != 2:
                raise ProtocolError("bad field")
            off, fmt = f
            if type(fmt) is not str or len(fmt) != 1 or fmt not in wire.RAW_FORMATS:
                raise ProtocolError(f"bad field format {str(fmt)[:8]!r}")
            if type(off) is not int or not 0 <= off or off + struct.calcsize("<" + fmt) > size:
                raise ProtocolError(f"field {name[:64]!r} outside the record")
            fields[name] = (off, fmt)
        missing = [f for f in FIELDS[rec] if f not in fields]
        if missing:
            raise ProtocolError(f"layout of kind {code} lacks {missing[:3]}")
        if fields["kind"] != (0, "I") and fields["kind"] != (0, "i"):
            raise ProtocolError("the kind field must be a 4-byte integer at offset 0")
        kinds[code] = KindLayout(code, rec, size, fields)
    ck_in = msg.get("copy_kinds", {})
    if type(ck_in) is not dict or len(ck_in) > 64:
        raise ProtocolError("bad copy_kinds")
    copy_kinds = {}
    for k, v in ck_in.items():
        if type(v) is not str or v not in COPY_KINDS:
            raise ProtocolError("bad copy kind")
        copy_kinds[_code(k)] = v
    return Layout(kinds, copy_kinds)


class NameReader:
    """Kernel names by pointer from the target's memory (``/proc/PID/mem``, one fd opened on
    first use). Cached pointer -> name (bounded: cleared when full). A null pointer or a failed
    read gives ``unresolved:0x…`` (cached, counted in ``unresolved``). Never raises."""
    PAGE = 4096

    def __init__(self, pid: int, max_entries: int = 100_000, max_len: int = MAX_STR) -> None:
        self.pid = pid
        self.max_entries = max_entries
        self.max_len = max_len
        self.cache: dict[int, str] = {}
        self.unresolved = 0
        self._fd: int | None = None
        self._open_failed = False
        self._lock = threading.Lock()
        self._closed = False

    def get(self, ptr: int) -> str:
        name = self.cache.get(ptr)
        return name if name is not None else self.read(ptr)

    def _read_bytes(self, ptr: int) -> bytes | None:
        if type(ptr) is not int or ptr <= 0 or ptr > MAX_INT - self.max_len:
            return None
        with self._lock:
            if self._closed:
                return None
            if self._fd is None:
                if self._open_failed:
                    return None
                try:
                    self._fd = os.open(f"/proc/{self.pid}/mem", os.O_RDONLY | os.O_CLOEXEC)
                except OSError:
                    self._open_failed = True
                    return None
            fd = self._fd
            parts = []
            got = 0
            addr = ptr
            while got < self.max_len:
                n = min(self.PAGE - addr % self.PAGE, self.max_len - got)
                try:
                    chunk = os.pread(fd, n, addr)
                except (OSError, OverflowError, ValueError):
                    chunk = b""
                if not chunk:
                    if not parts:
                        return None
                    break                 # readable start, unmapped tail: keep what we have
                z = chunk.find(b"\0")
                if z >= 0:
                    parts.append(chunk[:z])
                    break
                parts.append(chunk)
                got += len(chunk)
                addr += len(chunk)
            return b"".join(parts)

    def read(self, ptr: int) -> str:
        try:
            data = self._read_bytes(ptr)
            if data is None:
                name = None
            else:
                name = data.decode("utf-8", "replace")[:self.max_len]
        except Exception:
            name = None
        if name is None:
            self.unresolved += 1
            try:
                name = f"unresolved:0x{ptr:x}"
            except (TypeError, ValueError):
                name = "unresolved:?"
        cache = self.cache
        if len(cache) >= self.max_entries:
            cache.clear()
        if type(ptr) is int:
            cache[ptr] = name
        return name

    def close(self) -> None:
        with self._lock:
            self._closed = True
            fd, self._fd = self._fd, None
            if fd is not None:
                try:
                    os.close(fd)
                except OSError:
                    pass


def _header(h) -> tuple[int, str, int, int]:
    if type(h) is not dict or h.get("t") != "cupti_raw":
        raise ProtocolError("not a cupti_raw header")
    off_ns = h.get("off_ns")
    if type(off_ns) is not int or not -(1 << 63) <= off_ns < (1 << 63):
        raise ProtocolError("bad off_ns")
    mode = h.get("mode")
    if mode != "sizes" and mode != "offsets":
        raise ProtocolError("bad mode")
    n_offs = h.get("n_offs")
    if type(n_offs) is not int or not 0 <= n_offs <= MAX_OFFS or (mode == "sizes" and n_offs):
        raise ProtocolError("bad n_offs")
    align = h.get("align")
    if type(align) is not int or align not in ALIGNS:
        raise ProtocolError("bad align")
    return off_ns, mode, n_offs, align


def parse_raw(header: dict, body, layout: Layout, names: NameReader) -> tuple[list, dict]:
    """One raw frame -> (records, counters). Raises ProtocolError for a bad header or a buffer
    whose structure is wrong (offsets out of range / not increasing, a truncated record); records
    with out-of-range values, unknown kinds (mode "offsets") or an unfinished kernel (end 0) are
    skipped and counted."""
    off_ns, mode, n_offs, align = _header(header)
    if type(layout) is not Layout:
        raise ProtocolError("no layout")
    mv = memoryview(body)
    if len(mv) < 4 * n_offs:
        raise ProtocolError("body shorter than its offsets")
    buf = mv[4 * n_offs:]
    n = len(buf)
    kinds = layout.kinds
    copy_kinds = layout.copy_kinds
    u32 = _U32.unpack_from
    out = []
    append = out.append
    incomplete = unknown = bad = 0
    unresolved0 = names.unresolved
    ncache = names.cache
    nread = names.read
    KR, MR = KernelRecord, MemcpyRecord
    MI = MAX_INT
    if mode == "offsets":
        offsets = struct.unpack_from(f"<{n_offs}I", mv, 0) if n_offs else ()
        mask = 0
    else:
        offsets = None
        mask = align - 1
    i = 0
    prev = -1
    off = 0
    while True:
        if offsets is not None:
            if i >= n_offs:
                break
            off = offsets[i]
            i += 1
            if off <= prev:
                raise ProtocolError("record offsets not increasing")
            prev = off
            if off + 4 > n:
                raise ProtocolError("record offset outside the buffer")
        elif off + 4 > n:
            break
        kl = kinds.get(u32(buf, off)[0])
        if kl is None:
            unknown += 1
            if offsets is None:
                break
            continue
        size = kl.size
        if off + size > n:
            raise ProtocolError("record runs past the buffer")
        rec = kl.rec
        v = kl.read(buf, off)
        if offsets is None:
            off = (off + size + mask) & ~mask
        if rec == "kernel":
            s, e, dev, strm, corr, gx, gy, gz, bx, by, bz, ptr, graph = v
            if not e or e < s:
                incomplete += 1
                continue
            s += off_ns
            e += off_ns
            if s < 0:
                s = 0
            if e < 0:
                e = 0
            # (a | b | ...) >> 63 is non-zero iff one of them is negative or >= 2**63
            if e > MI or (strm | corr | graph | gx | gy | gz | bx | by | bz) >> 63 or not 0 <= dev <= MAX_DEVICE:
                bad += 1
                continue
            name = ncache.get(ptr)
            if name is None:
                name = nread(ptr)
            append(KR(name, s, e, dev, strm, corr, (gx, gy, gz), (bx, by, bz), graph))
        else:
            if rec == "memcpy":
                ck, nbytes, s, e, dev, strm, corr = v
                kind = copy_kinds.get(ck, "other")
            else:
                nbytes, s, e, dev, strm, corr = v
                kind = "memset"
            if e < s:
                e = s
            s += off_ns
            e += off_ns
            if s < 0:
                s = 0
            if e < 0:
                e = 0
            if e > MI or (nbytes | strm | corr) >> 63 or not 0 <= dev <= MAX_DEVICE:
                bad += 1
                continue
            append(MR(kind, nbytes, s, e, dev, strm, corr))
    counters = {"raw_records": len(out), "raw_incomplete": incomplete, "raw_unknown_kind": unknown,
                "raw_bad_record": bad, "raw_unresolved_names": names.unresolved - unresolved0}
    return out, counters


__all__ = ["ProtocolError", "Layout", "KindLayout", "NameReader", "parse_layout", "parse_raw", "MAX_STR", "MAX_INT"]
