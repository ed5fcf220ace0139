"""Symbolize the raw Python stacks recorded by pystack.h: code object -> (file, qualname, line).

No privilege of its own: every read of the target goes through `ProcessMemory`
(`introspect.memory.ProcMem` over /proc/PID/mem in production, fakes in tests). Cost: a cache hit
is two dict lookups; a miss reads the code object (~5 small reads, a few µs each) and decodes
its line table once.

Cache invalidation: BPF records, with each code address, a tag folded from the code object's
`co_filename` and `co_name` pointers *at the time of the probe*. Entries are keyed by
(address, tag): a code object freed and another allocated at the same address gives another
tag, hence a miss and a fresh read; a read whose tag no longer matches the event's (the object
died between the probe and the read) yields a marked `[stale code object]` frame, never a
wrong name. Two objects with the same names can share an address in turn (two lambdas of one
file, freed and allocated while a program starts up): a frame at an offset not seen before
checks the cached entry against the object's co_qualname pointer and co_firstlineno and reads
it afresh when they changed (a frame already cached by offset is not checked again).

Everything read from the target is untrusted: an object freed and reused between the probe and
the read, or torn by a write while it is read, can hold anything. No such object raises out of
`PySymbolizer.frame`: each kind is counted in `SymbolizerStats` and its frame marked — an
unreadable code object `[unreadable code object]`, a str that is none
`[unreadable code object name]`, a line table that does not decode the function's first line.
"""

from __future__ import annotations

import ctypes as ct
import struct
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable, NamedTuple, Optional, Sequence

from stacklens.cct import Frame
from stacklens.errors import MemoryReadError
from stacklens.introspect.memory import ProcessMemory, read_u64
from stacklens.textsafe import safe_text

if TYPE_CHECKING:
    from stacklens.introspect.python_layouts import PyLayout


# ---- mirror of pystack.h structs (tests/bpf/test_pystack.py checks them against the C) ----

SL_PY_OK, SL_PY_NOT_TARGET, SL_PY_NO_TSTATE, SL_PY_BAD_TSTATE, SL_PY_READ_ERR = range(5)
SL_PYF_ENTRY, SL_PYF_NOCODE = 1, 2
STATUS_NAMES = {0: "ok", 1: "not_target", 2: "no_tstate", 3: "bad_tstate", 4: "read_error"}


class SlPyFrame(ct.Structure):
    _fields_ = [("code", ct.c_uint64), ("tag", ct.c_uint64), ("offset", ct.c_int32),
                ("flags", ct.c_uint32)]


def sl_pystack_struct(max_depth: int) -> type[ct.Structure]:
    """ctypes mirror of `struct sl_pystack` for a given -DSL_PY_MAX_DEPTH."""
    return type(f"SlPyStack{max_depth}", (ct.Structure,), {"_fields_": [
        ("depth", ct.c_uint32), ("status", ct.c_uint16), ("truncated", ct.c_uint8),
        ("pad", ct.c_uint8), ("tstate", ct.c_uint64), ("frames", SlPyFrame * max_depth)]})


class RawPyFrame(NamedTuple):
    code: int
    tag: int
    offset: int
    flags: int = 0


class RawPyStack(NamedTuple):
    """A stack as BPF recorded it: frames innermost first."""

    status: int
    truncated: bool
    frames: tuple[RawPyFrame, ...]

    @classmethod
    def from_struct(cls, s: ct.Structure) -> "RawPyStack":
        n = min(s.depth, len(s.frames))
        return cls(s.status, bool(s.truncated), tuple(
            RawPyFrame(f.code, f.tag, f.offset, f.flags) for f in s.frames[:n]))

    @classmethod
    def from_bytes(cls, data: bytes, max_depth: int) -> "RawPyStack":
        st = sl_pystack_struct(max_depth)
        return cls.from_struct(st.from_buffer_copy(data[:ct.sizeof(st)]))


# ---- line tables -----------------------------------------------------------------------------


class BadObject(MemoryReadError):
    """Read from the target, but not what it claims to be (a truncated line table, a str of no
    known kind or too long): the object was freed and reused, or torn while it was read.
    `kind` ("linetable", "string") names its counter in `SymbolizerStats`. A `MemoryReadError`
    (the read gave no usable object), kept here: only the symbolizer raises and catches it."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


def line_ranges_311(table: bytes, firstlineno: int) -> list[tuple[int, int, int]]:
    """3.11+ location table -> [(start, end, line)] in code units; line -1 = none.
    Raises BadObject("linetable") where an entry runs past the table's end."""
    out = []
    line, addr, i, n = firstlineno, 0, 0, len(table)

    def varint(i: int) -> tuple[int, int]:
        if i >= n:
            raise BadObject("linetable", f"location table truncated at byte {i} of {n}")
        b = table[i]
        val, shift = b & 63, 6
        i += 1
        while b & 64:
            if i >= n:
                raise BadObject("linetable", f"location table truncated at byte {i} of {n}")
            b = table[i]
            val |= (b & 63) << shift
            shift += 6
            i += 1
        return val, i

    def svarint(i: int) -> tuple[int, int]:
        v, i = varint(i)
        return (-(v >> 1) if v & 1 else v >> 1), i

    while i < n:
        first = table[i]
        if not first & 0x80:   # every entry's first byte has its top bit set: not a location table
            raise BadObject("linetable", f"location table entry at byte {i} of {n} has no start bit")
        i += 1
        code, length = (first >> 3) & 15, (first & 7) + 1
        if code == 15:
            lineno = -1
        elif code == 14:
            d, i = svarint(i)
            line += d
            lineno = line
            _, i = varint(i)
            _, i = varint(i)
            _, i = varint(i)
        elif code == 13:
            d, i = svarint(i)
            line += d
            lineno = line
        elif code >= 10:
            line += code - 10
            lineno = line
            i += 2
        else:
            lineno = line
            i += 1
        if i > n:
            raise BadObject("linetable", f"location table truncated at byte {n}")
        out.append((addr, addr + length, lineno))
        addr += length
    return out


def line_ranges_310(table: bytes, firstlineno: int) -> list[tuple[int, int, int]]:
    """3.10 co_linetable (PEP 626 pairs) -> [(start, end, line)] in code units."""
    out = []
    line, addr = firstlineno, 0
    for j in range(0, len(table) - 1, 2):
        sdelta, ldelta = table[j], struct.unpack("b", table[j + 1:j + 2])[0]
        if ldelta == -128:
            lineno = -1
        else:
            line += ldelta
            lineno = line
        if sdelta:
            out.append((addr // 2, (addr + sdelta) // 2, lineno))
        addr += sdelta
    return out


def line_of(ranges: Sequence[tuple[int, int, int]], unit: int, firstlineno: int) -> int:
    if unit < 0:
        return firstlineno
    for start, end, line in ranges:
        if start <= unit < end:
            return line if line >= 0 else firstlineno
    return firstlineno


# ---- reading objects -------------------------------------------------------------------------


def read_unicode(mem: ProcessMemory, lay: "PyLayout", addr: int, limit: int = 4096) -> str:
    length = read_u64(mem, addr + lay.unicode_length)
    state = struct.unpack("<I", mem.read(addr + lay.unicode_state, 4))[0]
    kind, compact, ascii_ = (state >> 2) & 7, (state >> 5) & 1, (state >> 6) & 1
    if not compact or kind not in (1, 2, 4) or length > limit:
        raise BadObject("string", f"no str object at {addr:#x} (kind {kind}, compact {compact}, "
                                  f"length {length})")
    if ascii_:
        return mem.read(addr + lay.unicode_ascii_size, length).decode("ascii", "replace")
    raw = mem.read(addr + lay.unicode_compact_size, length * kind)
    enc = {1: "latin-1", 2: "utf-16-le", 4: "utf-32-le"}[kind]
    return raw.decode(enc, "replace")


def read_bytes_obj(mem: ProcessMemory, lay: "PyLayout", addr: int, limit: int = 1 << 20) -> bytes:
    n = read_u64(mem, addr + lay.bytes_size)
    if n > limit:
        raise MemoryReadError(f"bytes object at {addr:#x} too large ({n})")
    return mem.read(addr + lay.bytes_sval, n) if n else b""


@dataclass(frozen=True)
class CodeInfo:
    filename: str
    qualname: str
    firstlineno: int
    ranges: tuple[tuple[int, int, int], ...]
    lines_ok: bool = True   # False: the line table did not decode (frames get the first line)


@dataclass
class SymbolizerStats:
    hits: int = 0      # frame resolved from the cache
    misses: int = 0    # code object read from the target
    stale: int = 0     # code object gone/reused before it could be read
    errors: int = 0    # unreadable code object (its header), or a frame without one
    remains: int = 0   # freed code object named from its tag-checked remains (first line only)
    bad_linetables: int = 0  # line table unreadable or not decodable: the frame has the first line
    bad_strings: int = 0     # co_filename / co_qualname unreadable or not a str: frame marked

    def count(self, kind: str) -> None:
        """One bad object of `kind` (BadObject.kind)."""
        if kind == "linetable":
            self.bad_linetables += 1
        elif kind == "string":
            self.bad_strings += 1
        else:
            self.errors += 1

    def hit_rate(self) -> float:
        total = self.hits + self.misses + self.stale + self.errors + self.bad_strings
        return self.hits / total if total else 0.0


UNREADABLE_CODE = Frame.other("[unreadable code object]")
UNREADABLE_NAME = Frame.other("[unreadable code object name]")


class PySymbolizer:
    """Raw frames -> `Frame.python(file, qualname, line)`, with a bounded (addr, tag) cache."""

    def __init__(self, mem: ProcessMemory, layout: "PyLayout", code_type_addr: int = 0,
                 max_entries: int = 65536) -> None:
        self.mem = mem
        self.layout = layout
        self.code_type_addr = code_type_addr
        self.max_entries = max_entries
        self._codes: OrderedDict[tuple[int, int], CodeInfo] = OrderedDict()
        self._frames: dict[tuple[int, int, int], Frame] = {}
        # per code address, the tags cached there and their frames' offsets (so an entry found
        # stale drops its frames too), and what identified the object when it was read
        self._at: dict[int, dict[int, set[int]]] = {}
        self._ident: dict[tuple[int, int], bytes] = {}
        self.stats = SymbolizerStats()

    def _read_code(self, code: int, tag: int) -> Optional[CodeInfo]:
        lay, mem = self.layout, self.mem
        freed = bool(self.code_type_addr) and read_u64(mem, code + lay.ob_type) != self.code_type_addr
        if freed and not tag:
            return None
        fn_ptr = read_u64(mem, code + lay.code_filename)
        name_ptr = read_u64(mem, code + lay.code_name)
        if tag and (fn_ptr ^ name_ptr) != tag:
            return None
        qual_ptr = read_u64(mem, code + lay.code_qualname) if lay.code_qualname >= 0 else name_ptr
        first = struct.unpack("<i", mem.read(code + lay.code_firstlineno, 4))[0]
        if freed:
            # Freed since the probe, not reused: the allocator wrote its links over the header
            # (ob_refcnt, ob_type) but the fields the tag was folded from are as BPF saw them — a
            # module body that finished importing within milliseconds of the sample, at start-up.
            # Its names are read from those remains (the strings are the module's, usually still
            # alive; read_unicode checks them); its line table went with it: the first line.
            try:
                filename = read_unicode(mem, lay, fn_ptr)
                try:
                    qualname = read_unicode(mem, lay, qual_ptr)
                except MemoryReadError:   # freed with it; co_name ("<module>") is interned
                    qualname = read_unicode(mem, lay, name_ptr)
                info = CodeInfo(safe_text(filename), safe_text(qualname), first, ())
            except MemoryReadError:
                return None
            self.stats.remains += 1
            return info
        filename, qualname = self._str(fn_ptr), self._str(qual_ptr)
        table_ptr = read_u64(mem, code + lay.code_linetable)
        decode = line_ranges_311 if lay.linetable_format == 311 else line_ranges_310
        try:
            return CodeInfo(filename, qualname, first, tuple(decode(read_bytes_obj(mem, lay, table_ptr), first)))
        except MemoryReadError:   # BadObject too
            # names read and tag-checked, the line table not: the frame keeps its function
            self.stats.count("linetable")
            return CodeInfo(filename, qualname, first, (), lines_ok=False)

    def _str(self, addr: int) -> str:
        """co_filename / co_qualname: BadObject("string") when it is no str or cannot be read.
        The target names its code as it likes: control characters escaped here, once per code
        object, so no view or metric label downstream gets an ESC (textsafe.py)."""
        try:
            return safe_text(read_unicode(self.mem, self.layout, addr))
        except BadObject:
            raise
        except MemoryReadError as e:
            raise BadObject("string", f"str at {addr:#x} unreadable: {e}") from e

    def _identity(self, code: int) -> bytes:
        """co_qualname pointer and co_firstlineno: what tells apart two code objects that had
        the same address and the same co_filename/co_name (the tag), e.g. two lambdas of a file."""
        lay = self.layout
        q = self.mem.read(code + lay.code_qualname, 8) if lay.code_qualname >= 0 else b""
        return q + self.mem.read(code + lay.code_firstlineno, 4)

    def code_info(self, code: int, tag: int, verify: bool = False) -> Optional[CodeInfo]:
        """`verify`: check a cached entry against the object now at `code` (one 12-byte read)
        and read it afresh if another object took the address with the same tag — a process
        that is starting up frees and reuses code objects all the time. An unreadable address
        keeps the entry: events recorded before the object died still name it."""
        key = (code, tag)
        info = self._codes.get(key)
        if info is not None:
            try:
                same = not verify or self._identity(code) == self._ident.get(key)
            except MemoryReadError:
                same = True
            if same:
                self._codes.move_to_end(key)
                return info
            self._forget(code, tag)
        try:
            ident = self._identity(code)
        except MemoryReadError:
            ident = b""
        info = self._read_code(code, tag)
        # an entry whose line table did not decode is not kept: the next frame reads it again
        # (torn while it was read, or freed since: the tag or the verify tells then)
        if info is not None and info.lines_ok:
            self._codes[key] = info
            self._ident[key] = ident
            self._at.setdefault(code, {}).setdefault(tag, set())
            if len(self._codes) > self.max_entries:
                old, _ = self._codes.popitem(last=False)
                self._forget(*old)
        return info

    def _forget(self, code: int, tag: int) -> None:
        tags = self._at.get(code, {})
        for off in tags.pop(tag, ()):
            self._frames.pop((code, tag, off), None)
        if not tags:
            self._at.pop(code, None)
        self._codes.pop((code, tag), None)
        self._ident.pop((code, tag), None)

    def frame(self, raw: RawPyFrame) -> Frame:
        key = (raw.code, raw.tag, raw.offset)
        fr = self._frames.get(key)
        if fr is not None:
            self.stats.hits += 1
            return fr
        if not raw.code or raw.flags & SL_PYF_NOCODE:
            self.stats.errors += 1
            return Frame.other("[unknown python frame]")
        try:
            info = self.code_info(raw.code, raw.tag, verify=True)
        except BadObject as e:
            self.stats.count(e.kind)
            return UNREADABLE_NAME if e.kind == "string" else UNREADABLE_CODE
        except MemoryReadError:
            self.stats.errors += 1
            return UNREADABLE_CODE
        if info is None:
            self.stats.stale += 1
            return Frame.other("[stale code object]")
        self.stats.misses += 1
        unit = raw.offset // 2 if raw.offset >= 0 else -1
        fr = Frame.python(info.filename, info.qualname, line_of(info.ranges, unit, info.firstlineno))
        if len(self._frames) < 8 * self.max_entries and raw.tag in self._at.get(raw.code, {}):
            self._frames[key] = fr
            self._at[raw.code][raw.tag].add(raw.offset)
        return fr

    def symbolize(self, raw: RawPyStack | Iterable[RawPyFrame],
                  truncated: bool = False) -> tuple[Frame, ...]:
        """Outermost first; a `[truncated]` frame leads when the outermost frames are missing."""
        if isinstance(raw, RawPyStack):
            frames, truncated = raw.frames, raw.truncated
        else:
            frames = tuple(raw)
        out = [self.frame(f) for f in reversed(frames)]
        if truncated:
            out.insert(0, Frame.other("[truncated]"))
        return tuple(out)

    def entry_flags(self, raw: RawPyStack) -> tuple[bool, ...]:
        """Outermost first, aligned with symbolize(): True where an eval-loop invocation begins
        (the splice points for native stacks: one per _PyEval_EvalFrameDefault frame)."""
        return tuple(bool(f.flags & SL_PYF_ENTRY) for f in reversed(raw.frames))
