"""Library discovery and native-frame symbolization from /proc/PID/maps.

Maps are parsed by `stacklens.procfs`, ELF files read by `stacklens.elf`. No privileges beyond
reading /proc/PID (root for other users' processes). Files are opened through /proc/PID/root so
a target in a container resolves to its own files. Symbol tables are cached per (device, inode,
mtime), so each file is parsed once per daemon however many processes map it.
"""

from __future__ import annotations

import os
import re
from bisect import bisect_right
from collections.abc import Iterable
from dataclasses import dataclass

from stacklens.demangle import demangle
from stacklens.elf import ElfFile, SymbolTable
from stacklens.errors import NoSuchProcess
from stacklens.procfs import Mapping, ProcFS

from .frames import Frame


@dataclass(frozen=True)
class LibraryFile:
    """One distinct file (by device + inode) a process maps."""

    path: str          # path as the target sees it
    host_path: str     # /proc/PID/root/<path>: what we open and attach to
    dev: str
    inode: int

    @property
    def key(self) -> tuple[str, int]:
        return (self.dev, self.inode)


def find_libraries(pid: int, pattern: re.Pattern[str], proc: str = "/proc",
                   maps: Iterable[Mapping] | None = None) -> list[LibraryFile]:
    """Every distinct file matching `pattern` (on its basename) that the process maps.

    maps: the process's mappings when the caller already read them (one read for several
    patterns); read from `proc` otherwise."""
    procfs = ProcFS(proc)
    seen: dict[tuple[str, int], LibraryFile] = {}
    for m in procfs.maps(pid) if maps is None else maps:
        if not m.path.startswith("/") or m.inode == 0:
            continue
        path = m.path.removesuffix(" (deleted)")
        if not pattern.search(os.path.basename(path)):
            continue
        key = (m.dev, m.inode)
        if key not in seen:
            seen[key] = LibraryFile(path, str(procfs.target_path(pid, path)), m.dev, m.inode)
    return list(seen.values())


_TABLES: dict[tuple, SymbolTable | None] = {}


def symbol_table(host_path: str) -> SymbolTable | None:
    """Cached symbol table of a file, keyed by (dev, inode, mtime); None if unreadable."""
    try:
        st = os.stat(host_path)
    except OSError:
        return None
    key = (st.st_dev, st.st_ino, st.st_mtime_ns)
    if key not in _TABLES:
        try:
            with ElfFile(host_path) as elf:
                _TABLES[key] = SymbolTable(elf)
        except Exception:
            _TABLES[key] = None
    return _TABLES[key]


class Symbolizer:
    """Address -> Frame.native(lib, symbol) for one process, caching every answer.

    Unknown addresses become Frame.native(lib, "0x<file offset>") or Frame.other("[unknown]")."""

    def __init__(self, pid: int, proc: str = "/proc"):
        self.pid = pid
        self.proc = proc
        self._procfs = ProcFS(proc)
        self._maps: list[Mapping] = []
        self._starts: list[int] = []
        self._cache: dict[int, Frame] = {}
        self.refresh()

    def refresh(self) -> None:
        try:
            maps = [m for m in self._procfs.maps(self.pid) if "x" in m.perms]
        except NoSuchProcess:
            return  # keep what we had: the process exited, its events still need names
        self._maps = sorted(maps, key=lambda m: m.start)
        self._starts = [m.start for m in self._maps]

    def _find(self, addr: int) -> Mapping | None:
        i = bisect_right(self._starts, addr) - 1
        if i >= 0 and addr < self._maps[i].end:
            return self._maps[i]
        return None

    def frame(self, addr: int) -> Frame:
        f = self._cache.get(addr)
        if f is not None:
            return f
        m = self._find(addr)
        if m is None:
            self.refresh()
            m = self._find(addr)
        if m is None or not m.path.startswith("/"):
            f = Frame.other(f"[unknown 0x{addr:x}]" if m is None else f"[{m.path or 'anon'} 0x{addr:x}]")
        else:
            lib = os.path.basename(m.path)
            file_off = addr - m.start + m.offset
            table = symbol_table(str(self._procfs.target_path(self.pid, m.path.removesuffix(" (deleted)"))))
            name = None if table is None else table.lookup_offset(file_off)
            if name is None:
                f = Frame.native(lib, f"0x{file_off:x}")
            else:
                f = Frame.native(lib, demangle(name))  # cached there
        self._cache[addr] = f
        return f

    def stack(self, addrs) -> tuple[Frame, ...]:
        """Innermost-first addresses (as BPF returns them) -> outermost-first frames."""
        return tuple(self.frame(a) for a in reversed(addrs))
