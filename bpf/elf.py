"""Minimal pure-Python ELF64 reader: program headers, .dynsym/.symtab, address <-> file offset.

No privileges. Reads only headers and symbol tables (mmap), so a 500 MB libtorch_cpu.so costs
what its symbol table costs (~0.3 s for ~150k dynamic symbols).
"""

from __future__ import annotations

import mmap
import os
import struct
from bisect import bisect_right
from dataclasses import dataclass

from stacklens.errors import InputError

_EHDR = struct.Struct("<16sHHIQQQIHHHHHH")
_PHDR = struct.Struct("<IIQQQQQQ")
_SHDR = struct.Struct("<IIQQQQIIQQ")
_SYM = struct.Struct("<IBBHQQ")
PT_LOAD = 1
SHT_SYMTAB = 2
SHT_DYNSYM = 11
STT_FUNC = 2
STT_GNU_IFUNC = 10


@dataclass(frozen=True)
class Segment:
    vaddr: int
    offset: int
    filesz: int
    memsz: int
    flags: int


@dataclass(frozen=True)
class Symbol:
    name: str
    value: int  # virtual address in the file's own address space
    size: int


class ElfFile:
    """An ELF64 little-endian file, opened read-only and mapped."""

    def __init__(self, path: str):
        self.path = path
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError as e:
            raise InputError(f"cannot open {path}: {e.strerror}; check the path and permissions") from e
        try:
            st = os.fstat(fd)
            self.inode = st.st_ino
            self.mtime_ns = st.st_mtime_ns
            self.size = st.st_size
            if st.st_size < 64:
                raise InputError(f"{path} is not an ELF file (too short)")
            self._map = mmap.mmap(fd, 0, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        m = self._map
        if m[:4] != b"\x7fELF" or m[4] != 2 or m[5] != 1:
            raise InputError(f"{path} is not a 64-bit little-endian ELF file")
        (_, _, _, _, _, phoff, shoff, _, _, phentsize, phnum, shentsize, shnum, shstrndx) = _EHDR.unpack_from(m, 0)
        self.segments = []
        for i in range(phnum):
            p_type, p_flags, p_offset, p_vaddr, _, p_filesz, p_memsz, _ = _PHDR.unpack_from(m, phoff + i * phentsize)
            if p_type == PT_LOAD:
                self.segments.append(Segment(p_vaddr, p_offset, p_filesz, p_memsz, p_flags))
        self._sections = [_SHDR.unpack_from(m, shoff + i * shentsize) for i in range(shnum)] if shoff else []
        self._shstr = self._sections[shstrndx] if self._sections and shstrndx < len(self._sections) else None

    def close(self) -> None:
        self._map.close()

    def __enter__(self) -> "ElfFile":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _section_name(self, sh) -> str:
        if self._shstr is None:
            return ""
        start = self._shstr[4] + sh[0]
        end = self._map.find(b"\0", start)
        return self._map[start:end].decode("ascii", "replace")

    def vaddr_to_offset(self, vaddr: int) -> int | None:
        for s in self.segments:
            if s.vaddr <= vaddr < s.vaddr + s.filesz:
                return vaddr - s.vaddr + s.offset
        return None

    def offset_to_vaddr(self, offset: int) -> int | None:
        for s in self.segments:
            if s.offset <= offset < s.offset + max(s.filesz, 1):
                return offset - s.offset + s.vaddr
        return None

    def iter_symbols(self, tables=(SHT_DYNSYM,), funcs_only: bool = True, name_filter: bytes | None = None):
        """Yield (name, value, size) of defined symbols in the given section types.

        name_filter: only names containing these bytes (checked before decoding: fast on big tables)."""
        m = self._map
        for sh in self._sections:
            if sh[1] not in tables:
                continue
            strtab = self._sections[sh[6]]
            stroff = strtab[4]
            off, size, entsize = sh[4], sh[5], sh[9] or _SYM.size
            for i in range(entsize, size, entsize):
                st_name, st_info, _, st_shndx, st_value, st_size = _SYM.unpack_from(m, off + i)
                if st_shndx == 0 or st_value == 0:
                    continue
                if funcs_only and (st_info & 0xF) not in (STT_FUNC, STT_GNU_IFUNC):
                    continue
                start = stroff + st_name
                end = m.find(b"\0", start)
                raw = m[start:end]
                if name_filter is not None and name_filter not in raw:
                    continue
                yield raw.decode("utf-8", "replace"), st_value, st_size

    def symbol_offsets(self, names: list[str]) -> dict[str, int]:
        """File offsets of the named functions (dynsym first, then symtab)."""
        wanted = set(names)
        found: dict[str, int] = {}
        for name, value, _ in self.iter_symbols((SHT_DYNSYM, SHT_SYMTAB)):
            if name in wanted and name not in found:
                off = self.vaddr_to_offset(value)
                if off is not None:
                    found[name] = off
        return found


class SymbolTable:
    """Sorted function symbols of one file, for address -> name lookups."""

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
