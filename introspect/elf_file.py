"""One ELF64 file: program headers, sections, .dynsym/.symtab, address <-> file offset, load bias;
`SymbolTable` (address -> function) and `symbol_offsets` (name -> file offset, read once per version
of a file). Callers import these from `stacklens.introspect.elf`; the CFI reader built on this file's
`ElfFile` is `stacklens.introspect.elf_cfi`.

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
    def data(self) -> mmap.mmap | bytes:
        """The whole file (mapped): what readers of its parts (`elf_cfi.EhFrame`) index into."""
        return self._map

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
