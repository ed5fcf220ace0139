"""Minimal ELF64 little-endian reader: symbols, sections, the load bias of a mapped object.

Pure file parsing (no privilege); the file is usually opened through /proc/PID/root.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

from ..errors import NotApplicable

PT_LOAD = 1
ET_EXEC = 2
SHT_SYMTAB = 2
SHT_DYNSYM = 11


@dataclass(frozen=True)
class Section:
    name: str
    addr: int
    offset: int
    size: int


class ElfFile:
    def __init__(self, path: Path | str) -> None:
        self.path = str(path)
        with open(path, "rb") as f:
            try:
                self._data = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            except ValueError:  # empty file
                raise NotApplicable(f"{path} is not an ELF file") from None
        d = self._data
        if d[:4] != b"\x7fELF":
            raise NotApplicable(f"{path} is not an ELF file")
        if d[4] != 2 or d[5] != 1:
            raise NotApplicable(f"{path}: only 64-bit little-endian ELF is supported")
        (self.e_type, self.e_machine, _v, _entry, self.phoff, self.shoff, _flags, _ehsize,
         self.phentsize, self.phnum, self.shentsize, self.shnum, self.shstrndx) = struct.unpack_from(
            "<HHIQQQIHHHHHH", d, 16)
        self.segments = []
        for i in range(self.phnum):
            p_type, _fl, p_offset, p_vaddr, _pa, p_filesz, p_memsz, _al = struct.unpack_from(
                "<IIQQQQQQ", d, self.phoff + i * self.phentsize)
            if p_type == PT_LOAD:
                self.segments.append((p_offset, p_vaddr, p_filesz, p_memsz))
        self._shdrs = []
        for i in range(self.shnum):
            self._shdrs.append(struct.unpack_from("<IIQQQQIIQQ", d, self.shoff + i * self.shentsize))
        self.sections: dict[str, Section] = {}
        self._symtabs = []
        if self._shdrs and self.shstrndx < len(self._shdrs):
            stroff = self._shdrs[self.shstrndx][4]
            for sh in self._shdrs:
                name = self._cstr(stroff + sh[0])
                self.sections[name] = Section(name, sh[3], sh[4], sh[5])
                if sh[1] in (SHT_SYMTAB, SHT_DYNSYM):
                    self._symtabs.append(sh)

    def _cstr(self, off: int) -> str:
        end = self._data.find(b"\0", off)
        return self._data[off:end].decode(errors="replace")

    @property
    def is_pie_or_shared(self) -> bool:
        return self.e_type != ET_EXEC

    def symbols(self, names: set[str] | frozenset[str]) -> dict[str, int]:
        """Values (link-time addresses) of the named defined symbols (.dynsym, then .symtab)."""
        want = {n.encode() for n in names}
        out: dict[str, int] = {}
        d = self._data
        for sh in self._symtabs:
            _n, _t, _f, _a, off, size, link, _i, _al, entsize = sh
            if entsize == 0 or link >= len(self._shdrs):
                continue
            stroff = self._shdrs[link][4]
            for i in range(size // entsize):
                st_name, _info, _other, shndx, value, _sz = struct.unpack_from("<IBBHQQ", d, off + i * entsize)
                if shndx == 0 or value == 0:
                    continue
                start = stroff + st_name
                end = d.find(b"\0", start)
                name = d[start:end]
                if name in want:
                    out.setdefault(name.decode(), value)
            if len(out) == len(want):
                break
        return out

    def first_load_vaddr(self) -> int:
        """Page-aligned vaddr of the PT_LOAD that maps file offset 0."""
        for off, vaddr, _fs, _ms in self.segments:
            if off == 0:
                return vaddr & ~0xFFF
        return self.segments[0][1] & ~0xFFF if self.segments else 0

    def load_bias(self, mapping_starts_by_offset: dict[int, int]) -> int:
        """Bias = runtime address - link-time address, from the mappings of this file."""
        if not self.is_pie_or_shared:
            return 0
        if 0 in mapping_starts_by_offset:
            return mapping_starts_by_offset[0] - self.first_load_vaddr()
        for off, vaddr, _fs, _ms in self.segments:
            page_off = off & ~0xFFF
            if page_off in mapping_starts_by_offset:
                return mapping_starts_by_offset[page_off] - (vaddr & ~0xFFF)
        raise NotApplicable(f"cannot find the load address of {self.path}")

    def close(self) -> None:
        self._data.close()
