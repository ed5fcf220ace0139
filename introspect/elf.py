"""The ELF64 reader of stacklens: program headers, sections, .dynsym/.symtab, address <-> file offset,
load bias. Used by the BPF side (probe offsets, op discovery, native symbolization, the Python-stack
reader) and by the injector (finding `_PyRuntime` in a target), so it lives at the package root:
stdlib and `stacklens.errors` only.

Pure file parsing, no privileges. A target's files are opened through /proc/PID/root or
/proc/PID/map_files (`stacklens.introspect.procfs`). The file is mapped, not read, so a 500 MB
libtorch_cpu.so costs what its symbol table costs (~0.3 s for ~150k dynamic symbols).

Errors: a file that cannot be opened, is not a 64-bit little-endian ELF file or has headers
outside the file raises ``error`` (the constructor's argument, `InputError` by default; the
injector passes `NotApplicable`, the Python-stack reader `AttachError`).
"""

from __future__ import annotations

import functools
import mmap
import os
import struct
from bisect import bisect_right
from collections.abc import Collection, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from stacklens.errors import InputError

if TYPE_CHECKING:
    from stacklens.introspect.procfs import Mapping

_EHDR = struct.Struct("<16sHHIQQQIHHHHHH")
_PHDR = struct.Struct("<IIQQQQQQ")
_SHDR = struct.Struct("<IIQQQQIIQQ")
_SYM = struct.Struct("<IBBHQQ")
PT_LOAD = 1
ET_EXEC = 2
SHT_SYMTAB = 2
SHT_DYNSYM = 11
STT_FUNC = 2
STT_GNU_IFUNC = 10


@dataclass(frozen=True)
class Segment:
    """One PT_LOAD program header."""

    vaddr: int
    offset: int
    filesz: int
    memsz: int
    flags: int


@dataclass(frozen=True)
class Section:
    name: str
    addr: int
    offset: int
    size: int


@dataclass(frozen=True)
class Symbol:
    name: str
    value: int  # virtual address in the file's own address space
    size: int


class ElfFile:
    """An ELF64 little-endian file, opened read-only and mapped (read into memory where it cannot be)."""

    def __init__(self, path: str | os.PathLike, error: type[Exception] = InputError) -> None:
        self.path = str(path)
        self._error = error
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError as e:
            raise error(f"cannot open {self.path}: {e.strerror}; check the path and permissions") from e
        try:
            st = os.fstat(fd)
            self.inode = st.st_ino
            self.mtime_ns = st.st_mtime_ns
            self.size = st.st_size
            if st.st_size < 64:
                raise error(f"{self.path} is not an ELF file (too short)")
            try:
                self._map: mmap.mmap | bytes = mmap.mmap(fd, 0, prot=mmap.PROT_READ)
            except (OSError, ValueError):  # a file system without mmap: read it
                with os.fdopen(os.dup(fd), "rb") as f:
                    self._map = f.read()
        finally:
            os.close(fd)
        m = self._map
        if m[:4] != b"\x7fELF":
            self.close()
            raise error(f"{self.path} is not an ELF file")
        if m[4] != 2 or m[5] != 1:
            self.close()
            raise error(f"{self.path} is not a 64-bit little-endian ELF file (only those are supported)")
        try:
            (_, self.e_type, self.e_machine, _, _, phoff, shoff, _, _, phentsize, phnum, shentsize, shnum,
             shstrndx) = _EHDR.unpack_from(m, 0)
            self.segments: list[Segment] = []
            for i in range(phnum):
                p_type, p_flags, p_offset, p_vaddr, _, p_filesz, p_memsz, _ = _PHDR.unpack_from(
                    m, phoff + i * phentsize)
                if p_type == PT_LOAD:
                    self.segments.append(Segment(p_vaddr, p_offset, p_filesz, p_memsz, p_flags))
            self._sections = [_SHDR.unpack_from(m, shoff + i * shentsize) for i in range(shnum)] if shoff else []
        except struct.error:
            self.close()
            raise error(f"{self.path}: ELF headers point outside the file (truncated or corrupt)") from None
        self._shstr = self._sections[shstrndx] if shstrndx < len(self._sections) else None
        self._by_name: dict[str, Section] | None = None

    def close(self) -> None:
        if isinstance(self._map, mmap.mmap):
            self._map.close()

    def __enter__(self) -> "ElfFile":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- headers

    @property
    def is_pie_or_shared(self) -> bool:
        return self.e_type != ET_EXEC

    def _cstr(self, off: int) -> str:
        end = self._map.find(b"\0", off)
        return self._map[off:end].decode("utf-8", "replace")

    @property
    def sections(self) -> dict[str, Section]:
        """Section headers by name ({} when the file has no section name table)."""
        if self._by_name is None:
            self._by_name = {}
            if self._shstr is not None:
                for sh in self._sections:
                    name = self._cstr(self._shstr[4] + sh[0])
                    self._by_name[name] = Section(name, sh[3], sh[4], sh[5])
        return self._by_name

    def vaddr_to_offset(self, vaddr: int) -> int | None:
        for s in self.segments:
            if s.vaddr <= vaddr < s.vaddr + s.filesz:
                return vaddr - s.vaddr + s.offset
        return None

    def offset_to_vaddr(self, offset: int) -> int | None:
        return _offset_to_vaddr(self.segments, offset)

    def first_load_vaddr(self) -> int:
        """Page-aligned vaddr of the PT_LOAD that maps file offset 0."""
        for s in self.segments:
            if s.offset == 0:
                return s.vaddr & ~0xFFF
        return self.segments[0].vaddr & ~0xFFF if self.segments else 0

    def load_bias(self, mappings: Iterable[Mapping]) -> int:
        """Bias = runtime address - link-time address, from the mappings of this file in a
        process (`procfs.Mapping`s, as /proc/PID/maps lists them; only this file's). When two
        mappings share a file offset, the lowest start wins."""
        if not self.is_pie_or_shared:
            return 0
        starts: dict[int, int] = {}  # file offset -> lowest start mapping it
        for m in mappings:
            if m.offset not in starts or m.start < starts[m.offset]:
                starts[m.offset] = m.start
        if 0 in starts:
            return starts[0] - self.first_load_vaddr()
        for s in self.segments:
            page_off = s.offset & ~0xFFF
            if page_off in starts:
                return starts[page_off] - (s.vaddr & ~0xFFF)
        raise self._error(f"cannot find the load address of {self.path}")

    # -- symbols

    def iter_symbols(self, tables: Collection[int] = (SHT_DYNSYM,), funcs_only: bool = True,
                     name_filter: bytes | None = None,
                     names: Collection[bytes] | None = None) -> Iterator[tuple[str, int, int]]:
        """Yield (name, value, size) of defined symbols (section index and value non-zero) of the
        given section types, in section-header order.

        name_filter: only names containing these bytes; names: only these exact names (both
        checked before decoding: fast on big tables)."""
        m = self._map
        nsec = len(self._sections)
        for sh in self._sections:
            if sh[1] not in tables or sh[6] >= nsec:
                continue
            stroff = self._sections[sh[6]][4]
            off, size, entsize = sh[4], sh[5], sh[9] or _SYM.size
            for i in range(off + entsize, off + size - entsize + 1, entsize):
                st_name, st_info, _, st_shndx, st_value, st_size = _SYM.unpack_from(m, i)
                if st_shndx == 0 or st_value == 0:
                    continue
                if funcs_only and (st_info & 0xF) not in (STT_FUNC, STT_GNU_IFUNC):
                    continue
                start = stroff + st_name
                end = m.find(b"\0", start)
                raw = m[start:end]
                if name_filter is not None and name_filter not in raw:
                    continue
                if names is not None and raw not in names:
                    continue
                yield raw.decode("utf-8", "replace"), st_value, st_size

    def symbols(self, names: Collection[str]) -> dict[str, int]:
        """Values (link-time addresses) of the named defined symbols of any type (.dynsym and
        .symtab in section order, the first definition wins)."""
        want = frozenset(n.encode() for n in names)
        out: dict[str, int] = {}
        for name, value, _ in self.iter_symbols((SHT_DYNSYM, SHT_SYMTAB), funcs_only=False, names=want):
            out.setdefault(name, value)
            if len(out) == len(want):
                break
        return out

    def symbol_offsets(self, names: list[str]) -> dict[str, int]:
        """File offsets of the named functions (.dynsym and .symtab in section order)."""
        want = frozenset(n.encode() for n in names)
        found: dict[str, int] = {}
        for name, value, _ in self.iter_symbols((SHT_DYNSYM, SHT_SYMTAB), names=want):
            if name not in found:
                off = self.vaddr_to_offset(value)
                if off is not None:
                    found[name] = off
        return found


def file_identity(path: str) -> tuple[str, int, int, int, int]:
    """What names one version of a file: a result keyed by it is stale once the file changes."""
    st = os.stat(path)
    return (path, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=32)
def _cached_symbol_offsets(identity: tuple, names: tuple[str, ...]) -> dict[str, int]:
    with ElfFile(identity[0]) as elf:
        return elf.symbol_offsets(list(names))


def symbol_offsets(path: str, names: tuple[str, ...]) -> dict[str, int]:
    """ElfFile(path).symbol_offsets(names), read once per version of the file in this process: a
    daemon's second attach to a torch process skipped 1.5 s of libtorch_cpu's symbol table."""
    return dict(_cached_symbol_offsets(file_identity(path), tuple(names)))


def _offset_to_vaddr(segments: list[Segment], offset: int) -> int | None:
    for s in segments:
        if s.offset <= offset < s.offset + max(s.filesz, 1):
            return offset - s.offset + s.vaddr
    return None


class SymbolTable:
    """Sorted function symbols of one file, for address -> name lookups (outlives the ElfFile)."""

    def __init__(self, elf: ElfFile):
        syms: dict[int, tuple[str, int]] = {}
        for name, value, size in elf.iter_symbols((SHT_SYMTAB, SHT_DYNSYM)):
            prev = syms.get(value)
            if prev is None or (size and not prev[1]):
                syms[value] = (name, size)
        items = sorted(syms.items())
        self._addrs = [a for a, _ in items]
        self._names = [n for _, (n, _) in items]
        self._ends = [a + (s or 0) for a, (_, s) in items]
        self.segments = elf.segments

    def __len__(self) -> int:
        return len(self._addrs)

    def lookup(self, vaddr: int) -> str | None:
        i = bisect_right(self._addrs, vaddr) - 1
        if i < 0:
            return None
        end = self._ends[i]
        if end == self._addrs[i]:  # size unknown: accept up to the next symbol
            return self._names[i]
        return self._names[i] if vaddr < end else None

    def lookup_offset(self, file_offset: int) -> str | None:
        """The function at a file offset (what /proc/PID/maps gives: addr - start + offset)."""
        vaddr = _offset_to_vaddr(self.segments, file_offset)
        return None if vaddr is None else self.lookup(vaddr)


# -- call frame information (.eh_frame): how to find a caller's frame without frame pointers -----

# DWARF register numbers on x86-64
DW_RBP, DW_RSP, DW_RA = 6, 7, 16
CFA_PLT = -1          # the CFA is the PLT's expression (rsp + 8, + 8 more past the push): see CfiRule
_DEREF = "deref"      # EhFrame._run's state: the CFA is the word at register + offset
_S4 = struct.Struct("<i")
_HDR_ENTRY = struct.Struct("<ii")


@dataclass(frozen=True)
class CfiRule:
    """What a function's CFI says at one pc: CFA = register `cfa_reg` + `cfa_off` (CFA_PLT: the
    PLT's expression; `cfa_deref`: the CFA is the word stored there, GCC's stack realignment),
    `saved`: (DWARF register, offset from the CFA) of the registers saved on the stack (the
    return address is register 16), `saved_at`: (register, base register, offset) of those saved
    at an address given by another register (DW_CFA_expression `DW_OP_breg`, same realignment),
    `outermost`: the return address is undefined (_start, clone: the thread's first frame),
    `start`: the link-time address of the function's first instruction (its FDE's initial location)."""

    cfa_reg: int
    cfa_off: int
    saved: tuple[tuple[int, int], ...]
    outermost: bool
    start: int = 0
    cfa_deref: bool = False
    saved_at: tuple[tuple[int, int, int], ...] = ()


def _uleb(m, p: int) -> tuple[int, int]:
    r = s = 0
    while True:
        b = m[p]
        p += 1
        r |= (b & 0x7F) << s
        s += 7
        if b < 0x80:
            return r, p


def _sleb(m, p: int) -> tuple[int, int]:
    r = s = 0
    while True:
        b = m[p]
        p += 1
        r |= (b & 0x7F) << s
        s += 7
        if b < 0x80:
            if b & 0x40:
                r -= 1 << s
            return r, p


def _breg(m, p: int, end: int, tail: int) -> tuple[int, int] | None:
    """(register, offset) of a DWARF expression from p to end that is one DW_OP_breg<r> <sleb>
    followed by `tail` more bytes; None for any other expression."""
    if not 0x70 <= m[p] <= 0x8F:
        return None
    off, q = _sleb(m, p + 1)
    return (m[p] - 0x70, off) if q + tail == end else None


class EhFrame:
    """An ELF file's `.eh_frame` read through its `.eh_frame_hdr` search table: `rule(vaddr)`
    finds the FDE covering a link-time address by binary search and runs its CFA program up to
    that address. Nothing is parsed up front but the table (kept as the file's bytes); CIEs are
    parsed once each. Handles what GCC and Clang emit for x86-64 (the PLT's
    DW_CFA_def_cfa_expression is recognized as such; other expressions give no rule)."""

    def __init__(self, elf: ElfFile):
        self._m = m = elf._map
        self._elf = elf
        self._cies: dict[int, tuple] = {}
        self._n = 0
        self.available = False
        hdr = elf.sections.get(".eh_frame_hdr")
        if hdr is None or hdr.size < 12:
            return
        ver, _ptr_enc, cnt_enc, tab_enc = m[hdr.offset:hdr.offset + 4]
        if ver != 1 or tab_enc != 0x3B or cnt_enc != 0x03:   # datarel sdata4 table, udata4 count
            return
        self._hdr_vaddr = hdr.addr
        p = hdr.offset + 4
        p += 4 if _ptr_enc & 0x0F in (0x03, 0x0B) else 8
        self._n = struct.unpack_from("<I", m, p)[0]
        self._tab = p + 4
        self._locs = memoryview(m)[self._tab:self._tab + 8 * self._n].cast("i")[0::2] if not isinstance(m, bytes) \
            else memoryview(m[self._tab:self._tab + 8 * self._n]).cast("i")[0::2]
        self.available = self._n > 0

    def _fde_for(self, vaddr: int) -> int | None:
        rel = vaddr - self._hdr_vaddr
        i = bisect_right(self._locs, rel) - 1
        if i < 0:
            return None
        fde_vaddr = self._hdr_vaddr + _HDR_ENTRY.unpack_from(self._m, self._tab + 8 * i)[1]
        return self._elf.vaddr_to_offset(fde_vaddr)

    def _ptr(self, enc: int, p: int) -> tuple[int, int]:
        """An encoded pointer at file offset p -> (value, next offset); pcrel is made absolute."""
        m = self._m
        fmt = enc & 0x0F
        if fmt == 0x00 or fmt == 0x04:
            v, n = struct.unpack_from("<Q", m, p)[0], p + 8
        elif fmt == 0x03:
            v, n = struct.unpack_from("<I", m, p)[0], p + 4
        elif fmt == 0x0B:
            v, n = _S4.unpack_from(m, p)[0], p + 4
        elif fmt == 0x0C:
            v, n = struct.unpack_from("<q", m, p)[0], p + 8
        elif fmt == 0x02:
            v, n = struct.unpack_from("<H", m, p)[0], p + 2
        elif fmt == 0x0A:
            v, n = struct.unpack_from("<h", m, p)[0], p + 2
        elif fmt == 0x01:
            v, n = _uleb(m, p)
        elif fmt == 0x09:
            v, n = _sleb(m, p)
        else:
            raise ValueError(f"pointer encoding 0x{enc:x}")
        if enc & 0x70 == 0x10:
            v += self._elf.offset_to_vaddr(p) or 0
        return v, n

    def _cie(self, off: int) -> tuple:
        c = self._cies.get(off)
        if c is not None:
            return c
        m = self._m
        ln = struct.unpack_from("<I", m, off)[0]
        p = off + 8
        end = off + 4 + ln
        ver = m[p]
        p += 1
        z = m.find(b"\0", p)
        aug = bytes(m[p:z]).decode("ascii", "replace")
        p = z + 1
        code_align, p = _uleb(m, p)
        data_align, p = _sleb(m, p)
        if ver == 1:
            p += 1
        else:
            _, p = _uleb(m, p)
        fde_enc = 0x00
        if aug.startswith("z"):
            alen, p = _uleb(m, p)
            q = p
            for ch in aug[1:]:
                if ch == "R":
                    fde_enc = m[q]
                    q += 1
                elif ch == "P":
                    q = self._ptr(m[q] & 0x7F, q + 1)[1]
                elif ch == "L":
                    q += 1
            p += alen
        c = (code_align, data_align, fde_enc, p, end, aug.startswith("z"))
        self._cies[off] = c
        return c

    def rule(self, vaddr: int) -> CfiRule | None:
        """The CFI rule at link-time address `vaddr`; None where no FDE covers it or its program
        uses what this reader does not follow."""
        if not self.available:
            return None
        try:
            off = self._fde_for(vaddr)
            if off is None:
                return None
            m = self._m
            ln = struct.unpack_from("<I", m, off)[0]
            if ln == 0 or ln == 0xFFFFFFFF:
                return None
            cie_off = off + 4 - struct.unpack_from("<I", m, off + 4)[0]
            ca, da, enc, cie_ins, cie_end, has_z = self._cie(cie_off)
            start, p = self._ptr(enc, off + 8)
            length, p = self._ptr(enc & 0x0F, p)
            if not start <= vaddr < start + length:
                return None
            if has_z:
                alen, p = _uleb(m, p)
                p += alen
            state = [DW_RSP, 8, {DW_RA: -8}, False]
            self._run(cie_ins, cie_end, ca, da, enc, start, 1 << 64, state, None)
            init = (state[0], state[1], dict(state[2]), state[3])
            self._run(p, off + 4 + ln, ca, da, enc, start, vaddr, state, init)
        except (struct.error, IndexError, ValueError):
            return None
        if state[3] is None:
            return None
        saved = tuple((r, v) for r, v in state[2].items() if type(v) is int)
        at = tuple((r,) + v for r, v in state[2].items() if type(v) is tuple)
        ra = state[2].get(DW_RA)
        if type(ra) is tuple:
            return None
        return CfiRule(state[0], state[1], saved, ra is None, start, state[3] == _DEREF, at)

    def _run(self, p: int, end: int, ca: int, da: int, enc: int, loc: int, target: int, state: list,  # long: one dispatch over DWARF CFA opcodes, a call per opcode would cost the walk
             init) -> None:
        """Runs CFA instructions from p to end while loc <= target. state: [cfa_reg, cfa_off,
        {reg: offset from CFA, or (base register, offset): saved at an address given by another
        register; absent: same value / undefined for RA}, how the CFA is formed (False: register +
        offset, True: the PLT's expression, _DEREF: the word at register + offset, None: not followed)]."""
        m = self._m
        stack: list = []
        while p < end:
            op = m[p]
            p += 1
            hi, lo = op & 0xC0, op & 0x3F
            if hi == 0x40:
                loc += lo * ca
                if loc > target:
                    return
                continue
            if hi == 0x80:
                v, p = _uleb(m, p)
                state[2][lo] = v * da
                continue
            if hi == 0xC0:
                if init is not None and lo in init[2]:
                    state[2][lo] = init[2][lo]
                else:
                    state[2].pop(lo, None)
                continue
            if op == 0x00:
                continue
            if op in (0x02, 0x03, 0x04):
                n = {0x02: 1, 0x03: 2, 0x04: 4}[op]
                loc += int.from_bytes(m[p:p + n], "little") * ca
                p += n
                if loc > target:
                    return
            elif op == 0x01:
                loc, p = self._ptr(enc, p)
                if loc > target:
                    return
            elif op in (0x05, 0x11):
                r, p = _uleb(m, p)
                v, p = (_uleb if op == 0x05 else _sleb)(m, p)
                state[2][r] = v * da
            elif op == 0x06:
                r, p = _uleb(m, p)
                if init is not None and r in init[2]:
                    state[2][r] = init[2][r]
                else:
                    state[2].pop(r, None)
            elif op in (0x07, 0x08):
                r, p = _uleb(m, p)
                state[2].pop(r, None)
            elif op == 0x09:
                r, p = _uleb(m, p)
                _, p = _uleb(m, p)
                state[2].pop(r, None)      # saved in another register: not followed
            elif op == 0x0A:
                stack.append((state[0], state[1], dict(state[2]), state[3]))
            elif op == 0x0B:
                if stack:
                    state[0], state[1], state[2], state[3] = stack.pop()
            elif op == 0x0C:
                state[0], p = _uleb(m, p)
                state[1], p = _uleb(m, p)
                state[3] = False
            elif op == 0x12:
                state[0], p = _uleb(m, p)
                v, p = _sleb(m, p)
                state[1] = v * da
                state[3] = False
            elif op == 0x0D:
                state[0], p = _uleb(m, p)
            elif op == 0x0E:
                state[1], p = _uleb(m, p)
            elif op == 0x13:
                v, p = _sleb(m, p)
                state[1] = v * da
            elif op == 0x0F:
                n, p = _uleb(m, p)
                # the PLT's: rsp + 8 + ((rip & 15) >= 11) * 8 (DW_OP_breg7 8; DW_OP_breg16 0; ...)
                if m[p] == 0x77 and m[p + 2] == 0x80:
                    state[0], state[1], state[3] = CFA_PLT, 8, True
                else:
                    # GCC's stack realignment: DW_OP_breg<r> off; DW_OP_deref
                    b = _breg(m, p, p + n, 1)
                    if b is not None and m[p + n - 1] == 0x06:
                        state[0], state[1], state[3] = b[0], b[1], _DEREF
                    else:
                        state[0], state[1], state[3] = -2, 0, None
                p += n
            elif op in (0x10, 0x16):
                r, p = _uleb(m, p)
                n, p = _uleb(m, p)
                # saved at DW_OP_breg<b> off (the realignment's saves); other expressions: not followed
                b = _breg(m, p, p + n, 0) if op == 0x10 else None
                if b is not None:
                    state[2][r] = b
                else:
                    state[2].pop(r, None)
                p += n
            elif op in (0x14, 0x15):
                r, p = _uleb(m, p)
                _, p = (_uleb if op == 0x14 else _sleb)(m, p)
                state[2].pop(r, None)
            elif op == 0x2E:
                _, p = _uleb(m, p)
            elif op == 0x2F:
                r, p = _uleb(m, p)
                v, p = _uleb(m, p)
                state[2][r] = -v * da
            else:
                raise ValueError(f"CFA instruction 0x{op:x}")
