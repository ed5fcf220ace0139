"""Daemon side of the CUPTI collector (``inject/agent/gpu/cupti.py``; spec: ``inject/agent/wire.py``).

Pure apart from ``NameReader`` (reads /proc/PID/mem: root or CAP_SYS_PTRACE; one pread per new
kernel name, cached, and one per buffer read in place). CUPTI records reach the daemon three ways:
- JSON rows (cupti-python path: API records on, or no ctypes callbacks): the shared row decoder,
  ``rows.py`` (``MESSAGES`` lists them with the raw kinds);
- raw frames (``cupti_raw``): a completed CUPTI buffer copied as bytes, plus, once, a
  ``cupti_layout`` message that says where each field sits in each record kind;
- buffers read in place (``cupti_ref``): the address and length travel, the bytes are read from
  the target's memory (``NameReader.read_block``) and parsed as a raw frame.
Everything here is hostile input: the layout and every header are validated strictly
(``ProtocolError``), every read is bounds-checked, and one record with out-of-range values is
skipped and counted, never fatal. Kernel names are pointers into the target's memory, read by
``NameReader`` (cached, never raising).

The agent server hands every CUPTI message here through the vendor declaration
(``gpu.VENDORS["cupti"].decoder.decode``), raw frames as their bytes; the transports (``_raw_frame``,
``_ref_frame``) keep their per-connection state (the layout) in the server's ``Connection``.
The checks shared with the other decoders, ``ProtocolError``, ``MAX_STR`` and ``MAX_INT`` live in
``validate.py``.
"""

from __future__ import annotations

import dataclasses
import json
import operator
import struct
import threading

from stacklens.inject.agent import wire
from stacklens.errors import NoSuchProcess, PermissionDenied
from stacklens.introspect.memory import ProcMem, read_cstring
from stacklens.inject.channel.gpu import Connection
from stacklens.inject.channel.gpu.rows import ROW_KINDS, parse_rows
from stacklens.records.agent import KernelRecord, MemcpyRecord
from stacklens.textsafe import safe_text
from stacklens.inject.channel.validate import (MAX_INT, MAX_STR, ProtocolError, check_choice, check_dict, check_int, check_message,
                       check_row, check_str)

# the message kinds this vendor's collector sends with records: rows, then raw buffers
MESSAGES = ROW_KINDS + ("cupti_layout", "cupti_raw", "cupti_ref")
MAX_DEVICE = 1 << 16
MAX_BLOCK = wire.MAX_RAW_FRAME   # bytes of one CUPTI buffer read in place (cupti_ref)
MAX_RAW_HEADER = 4096           # bytes of a raw frame's JSON header
MAX_KINDS = 16
MAX_FIELDS = 40
MAX_OFFS = 200_000
MAX_KIND_CODE = 1000
ALIGNS = (1, 2, 4, 8, 16)
MODES = ("sizes", "offsets")
COPY_KINDS = wire.RAW_COPY_KINDS
MEMORY_KINDS = wire.RAW_MEMORY_KINDS
# required fields per record type (the first is always "kind"), in the order parse_raw reads them
FIELDS = wire.RAW_FIELDS
OPTIONAL = wire.RAW_OPTIONAL_FIELDS
_FORMATS = tuple(wire.RAW_FORMATS)      # one-letter struct formats (a tuple: "" is no format)
_U32 = struct.Struct("<I")


def decode(t: str, msg, conn: Connection) -> list:
    """One message of kind ``t`` (of MESSAGES) -> records; ``ProtocolError`` if malformed. Rows
    (cupti-python path) need nothing else; ``cupti_layout`` becomes this connection's layout (no
    records); ``cupti_raw`` (``msg``: the raw frame's bytes) and ``cupti_ref`` are buffers parsed
    with that layout, kernel names read through ``conn.memory``."""
    if t in ROW_KINDS:
        return parse_rows(t, msg)
    if t == "cupti_layout":
        conn.state["cupti"] = parse_layout(msg)     # each agent connection sends its own
        conn.counts["cupti_layouts"] += 1
        return []
    if t == "cupti_raw":
        if type(msg) is not bytes:
            raise ProtocolError("cupti_raw travels as a raw frame")
        return _raw_frame(msg, conn)
    if t == "cupti_ref":
        return _ref_frame(msg, conn)
    raise ProtocolError(f"not a CUPTI message: {str(t)[:32]!r}")


class KindLayout:
    """One record kind: its type, size and a reader ``read(buf, off) -> tuple`` of the FIELDS
    (without "kind") then the OPTIONAL fields, 0 for each one the layout does not have.
    ``memory``: a copy's layout has src_kind and dst_kind, a memset's memory_kind."""
    __slots__ = ("code", "rec", "size", "fields", "read", "memory")

    def __init__(self, code: int, rec: str, size: int, fields: dict) -> None:
        self.code, self.rec, self.size, self.fields = code, rec, size, fields
        want = FIELDS[rec][1:] + OPTIONAL[rec]
        self.read = _reader([(f, *fields[f]) if f in fields else None for f in want])
        self.memory = ("src_kind" in fields and "dst_kind" in fields) if rec == "memcpy" else "memory_kind" in fields


def _reader(spec):
    """Precompiled reader of (name, offset, fmt) fields (None: a field the layout lacks, read as
    0): few struct.Structs over non-overlapping runs (pad bytes between fields), then one
    itemgetter into the wanted order."""
    absent = [i for i in range(len(spec)) if spec[i] is None]
    pad_zero = bool(absent)
    order = sorted((i for i in range(len(spec)) if spec[i] is not None), key=lambda i: spec[i][1])
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
    for i in absent:
        pos[i] = k                  # a constant 0 after the unpacked values
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
    __slots__ = ("kinds", "copy_kinds", "memory_kinds", "_memory")

    def __init__(self, kinds: dict, copy_kinds: dict, memory_kinds: dict | None = None) -> None:
        self.kinds: dict[int, KindLayout] = kinds
        self.copy_kinds: dict[int, str] = copy_kinds
        self.memory_kinds: dict[int, str] = memory_kinds or {}
        self._memory: dict[tuple, str] = {}

    def memory(self, src: int, dst: int | None = None) -> str:
        """"Device -> Pinned" of a copy's (src, dst) codes, "Device" of a memset's one code
        (memoized: a few distinct pairs in a job)."""
        key = (src, dst)
        m = self._memory.get(key)
        if m is None:
            mk = self.memory_kinds
            m = mk.get(src, "Unknown") if dst is None else f"{mk.get(src, 'Unknown')} -> {mk.get(dst, 'Unknown')}"
            if len(self._memory) < 4096:
                self._memory[key] = m
        return m


def _code(k) -> int:
    """A kind code: JSON object keys arrive as strings ("10"); plain decimal only."""
    if type(k) is str and k.isascii() and k.isdigit() and len(k) <= 4:
        k = int(k)
    if type(k) is not int or not 0 <= k <= MAX_KIND_CODE:
        raise ProtocolError(f"bad kind code {str(k)[:16]!r}")
    return k


def parse_layout(msg) -> Layout:
    """A ``cupti_layout`` message -> Layout. Raises ProtocolError on anything unexpected."""
    check_message(msg, "cupti_layout", "not a cupti_layout message")
    kinds_in = check_dict(msg.get("kinds"), MAX_KINDS, "bad layout kinds", minlen=1)
    kinds = {}
    for k, v in kinds_in.items():
        code = _code(k)
        if code in kinds:
            raise ProtocolError("duplicate kind code")
        check_dict(v, MAX_INT, "bad kind layout")
        rec = check_choice(v.get("rec"), FIELDS, "bad record type")
        size = check_int(v.get("size"), 8, 4096, "bad record size")
        fields = {}
        for name, f in check_dict(v.get("fields"), MAX_FIELDS, "bad fields").items():
            check_str(name, 64, "bad field name")
            off, fmt = check_row(f, 2, "bad field")
            check_choice(fmt, _FORMATS, f"bad field format {str(fmt)[:8]!r}")
            check_int(off, 0, size - struct.calcsize("<" + fmt), f"field {name!r} outside the record")
            fields[name] = (off, fmt)
        missing = [f for f in FIELDS[rec] if f not in fields]
        if missing:
            raise ProtocolError(f"layout of kind {code} lacks {missing[:3]}")
        if fields["kind"] != (0, "I") and fields["kind"] != (0, "i"):
            raise ProtocolError("the kind field must be a 4-byte integer at offset 0")
        kinds[code] = KindLayout(code, rec, size, fields)
    copy_kinds = {}
    for k, v in check_dict(msg.get("copy_kinds", {}), 64, "bad copy_kinds").items():
        v = check_choice(v, COPY_KINDS, "bad copy kind")
        copy_kinds[_code(k)] = v
    memory_kinds = {}
    for k, v in check_dict(msg.get("memory_kinds", {}), 64, "bad memory_kinds").items():
        memory_kinds[_code(k)] = check_choice(v, MEMORY_KINDS, "bad memory kind")
    if not memory_kinds:             # codes without names say nothing: no memory kinds in the frames
        for kl in kinds.values():
            kl.memory = False
    return Layout(kinds, copy_kinds, memory_kinds)


class NameReader:
    """Kernel names by pointer from the target's memory (``/proc/PID/mem``, one fd opened on
    first use, read with ``memory.read_cstring``). Cached pointer -> name (bounded: cleared when
    full). A null pointer or a failed read gives ``unresolved:0x…`` (cached, counted in
    ``unresolved``). Never raises.

    A ``ProcMem``, not ``RemoteMemory`` (process_vm_readv by PID): its fd stays bound to the
    target's address space, so after the target exits a reused PID is never read, and ``close()``
    releases it."""

    def __init__(self, pid: int, max_entries: int = 100_000, max_len: int = MAX_STR) -> None:
        self.pid = pid
        self.max_entries = max_entries
        self.max_len = max_len
        self.cache: dict[int, str] = {}
        self.unresolved = 0
        self._mem: ProcMem | None = None
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
            if self._closed or not self._open():
                return None
            try:
                return read_cstring(self._mem, ptr, self.max_len)
            except OSError:
                return None

    def read_block(self, addr: int, n: int) -> bytes | None:
        """n bytes at addr (a CUPTI buffer the agent left in place: ``cupti_ref``), or None if
        the range cannot be read. The agent names the address; what comes back is parsed as
        untrusted data like any raw frame."""
        if type(addr) is not int or type(n) is not int or addr <= 0 or not 0 < n <= MAX_BLOCK \
                or addr > MAX_INT - n:
            return None
        with self._lock:
            if self._closed or not self._open():
                return None
            try:
                return self._mem.read(addr, n)
            except OSError:          # MemoryReadError: unmapped, short
                return None

    def readable(self) -> bool:
        """Whether the target's memory can be read at all (opens the fd now: it then stays bound
        to this process, see the class docstring)."""
        with self._lock:
            return not self._closed and self._open()

    def _open(self) -> bool:
        """The target's memory, opened once (caller holds the lock); False if it cannot be."""
        if self._mem is None:
            if self._open_failed:
                return False
            try:
                self._mem = ProcMem(self.pid)
            except (NoSuchProcess, PermissionDenied, OSError):
                self._open_failed = True
                return False
        return True

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
            mem, self._mem = self._mem, None
            if mem is not None:
                try:
                    mem.close()
                except OSError:
                    pass


def _header(h) -> tuple[int, str, int, int]:
    check_message(h, "cupti_raw", "not a cupti_raw header")
    off_ns = check_int(h.get("off_ns"), -(1 << 63), MAX_INT, "bad off_ns")
    mode = check_choice(h.get("mode"), MODES, "bad mode")
    n_offs = check_int(h.get("n_offs"), 0, MAX_OFFS if mode == "offsets" else 0, "bad n_offs")
    align = check_choice(h.get("align"), ALIGNS, "bad align", typ=int)
    return off_ns, mode, n_offs, align


def parse_raw(header: dict, body, layout: Layout, names: NameReader) -> tuple[list, dict]:
    """One raw frame -> (records, counters). Raises ProtocolError for a bad header or a buffer
    whose structure is wrong (offsets out of range / not increasing, a truncated record); records
    with out-of-range values, unknown kinds (mode "offsets") or an unfinished kernel, copy or
    memset (end 0) are skipped and counted."""
    off_ns, mode, n_offs, align = _header(header)
    if type(layout) is not Layout:
        raise ProtocolError("no layout")
    mv = memoryview(body)
    if len(mv) < 4 * n_offs:
        raise ProtocolError("body shorter than its offsets")
    if mode == "offsets":
        offsets = struct.unpack_from(f"<{n_offs}I", mv, 0) if n_offs else ()
        mask = 0
    else:
        offsets = None
        mask = align - 1
    unresolved0 = names.unresolved
    out, incomplete, unknown, bad = _records(mv[4 * n_offs:], offsets, mask, off_ns, layout, names)
    counters = {"raw_records": len(out), "raw_incomplete": incomplete, "raw_unknown_kind": unknown,
                "raw_bad_record": bad, "raw_unresolved_names": names.unresolved - unresolved0}
    return out, counters


def _records(buf, offsets, mask: int, off_ns: int, layout: Layout, names: NameReader) -> tuple[list, int, int, int]:
    """The records of a buffer, at ``offsets`` (mode "offsets") or one after the other, each
    aligned by ``mask`` (mode "sizes") -> (records, incomplete, unknown kind, bad). Kernels are
    decoded inline (the hot path), copies and memsets by ``_copy``."""
    n = len(buf)
    n_offs = len(offsets) if offsets is not None else 0
    kinds = layout.kinds
    u32 = _U32.unpack_from
    out = []
    append = out.append
    incomplete = unknown = bad = 0
    ncache = names.cache
    nread = names.read
    KR = KernelRecord
    MI = MAX_INT
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
        v = kl.read(buf, off)
        if offsets is None:
            off = (off + size + mask) & ~mask
        if kl.rec != "kernel":
            r = _copy(kl, v, layout, off_ns)
            if r is _INCOMPLETE:
                incomplete += 1
            elif r is _BAD:
                bad += 1
            else:
                append(r)
            continue
        s, e, dev, strm, corr, gx, gy, gz, bx, by, bz, ptr, graph, node = v
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
        if e > MI or (strm | corr | graph | node | gx | gy | gz | bx | by | bz) >> 63 or not 0 <= dev <= MAX_DEVICE:
            bad += 1
            continue
        name = ncache.get(ptr)
        if name is None:
            name = nread(ptr)
        append(KR(name, s, e, dev, strm, corr, (gx, gy, gz), (bx, by, bz), graph, node))
    return out, incomplete, unknown, bad


_INCOMPLETE = object()      # a copy or memset still in flight (end 0)
_BAD = object()             # a copy or memset with out-of-range values


def _copy(kl: KindLayout, v: tuple, layout: Layout, off_ns: int):
    """A copy's or memset's fields -> MemcpyRecord, or _INCOMPLETE / _BAD."""
    if kl.rec == "memcpy":
        ck, nbytes, s, e, dev, strm, corr, src, dst, graph = v
        kind = layout.copy_kinds.get(ck, "other")
        memory = layout.memory(src, dst) if kl.memory else ""
    else:
        nbytes, s, e, dev, strm, corr, mk, graph = v
        kind = "memset"
        memory = layout.memory(mk) if kl.memory else ""
    if not e:                    # in flight at a forced flush (as kernels): no GPU time yet
        return _INCOMPLETE
    if e < s:
        e = s
    s += off_ns
    e += off_ns
    if s < 0:
        s = 0
    if e < 0:
        e = 0
    if e > MAX_INT or (nbytes | strm | corr | graph) >> 63 or not 0 <= dev <= MAX_DEVICE:
        return _BAD
    return MemcpyRecord(kind, nbytes, s, e, dev, strm, corr, memory, graph)


# -- transports: how a buffer reaches the daemon (the agent server hands them here, ``decode``) --

def _raw_frame(raw: bytes, conn: Connection) -> list:
    """A raw CUPTI buffer frame (magic, header length, JSON header, body; wire.py) -> records."""
    conn.counts["raw_frames"] += 1

    def body():
        hl = int.from_bytes(raw[4:8], "big")
        if len(raw) < 8 or hl > MAX_RAW_HEADER or 8 + hl > len(raw):
            raise ProtocolError("bad raw header length")
        return json.loads(raw[8:8 + hl]), memoryview(raw)[8 + hl:]
    return _parse_buffer(body, conn)


def _ref_frame(msg: dict, conn: Connection) -> list:
    """A CUPTI buffer left in place in the target (``cupti_ref``: header, address, length):
    read through /proc/PID/mem, parsed like a raw frame, then handed back (``free``, through
    ``conn.to_free``) so the agent can reuse it. The target sends no bulk bytes over the socket
    for these buffers."""
    conn.counts["ref_frames"] += 1

    def body():
        addr = check_int(msg.get("a"), 1, MAX_INT)
        conn.to_free.append(addr)               # freed back whatever else is wrong with it
        n = check_int(msg.get("n"), 1, MAX_BLOCK)
        header = msg.get("h")
        if type(header) is not dict:
            raise ProtocolError("bad cupti_ref header")
        data = conn.memory.read_block(addr, n) if conn.memory is not None else None
        if data is None:
            conn.counts["ref_unreadable"] += 1
            raise ProtocolError("CUPTI buffer reference not readable")
        return header, data
    return _parse_buffer(body, conn)


def _parse_buffer(body, conn: Connection) -> list:
    """One CUPTI buffer (``body()`` -> header, bytes; raises ProtocolError) -> records, with the
    parser's counters in ``conn.counts``; anything wrong raises ProtocolError (the server rejects
    the message, counted, and the connection goes on)."""
    try:
        header, data = body()          # conn.memory: this connection's, opened at hello
        layout = conn.state.get("cupti")
        if layout is None:
            raise ProtocolError("CUPTI buffer before any cupti_layout")
        recs, counts = parse_raw(header, data, layout, conn.memory)
    except (ValueError, struct.error) as e:
        if isinstance(e, ProtocolError):
            raise
        raise ProtocolError(f"bad CUPTI buffer: {type(e).__name__}") from e
    for k, v in counts.items():
        if v:
            conn.counts[k] += v
    conn.counts["bytes"] += sum(len(getattr(r, "name", "")) for r in recs)
    return _safe_names(recs)


def _safe_names(recs: list) -> list:
    """Records of a raw CUPTI buffer with their names (kernel names read from the target's
    memory) escaped like every string from the agent (``textsafe.py``)."""
    for i, r in enumerate(recs):
        name = getattr(r, "name", None)
        if type(name) is str:
            safe = safe_text(name)
            if safe is not name:
                recs[i] = dataclasses.replace(r, name=safe)
    return recs


__all__ = ["ProtocolError", "Layout", "KindLayout", "NameReader", "parse_layout", "parse_raw", "MAX_STR", "MAX_INT"]
