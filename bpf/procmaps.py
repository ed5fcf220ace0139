"""Library discovery and native-frame symbolization from /proc/PID/maps.

Maps are parsed by `stacklens.introspect.procfs`, ELF files read by `stacklens.introspect.elf`. No privileges beyond
reading /proc/PID (root for other users' processes). Files are opened through /proc/PID/root so
a target in a container resolves to its own files. Symbol tables are cached per (device, inode,
mtime), so each file is parsed once per daemon however many processes map it.

Frames name functions, never addresses: a frame is part of a CCT node's identity, and a name per
address made a new node for every return address or sampled instruction not covered by a symbol.
A steady loop through a stripped library (libcuda.so exports only its cu* API) grew its profile
until max_nodes (docs/benchmarks/profile-growth.md). So an address no symbol covers is named by
where it lies, one frame per library:
- in a file: Frame.native(lib, "[stripped]") when the file has no .symtab (only its exports are
  known), Frame.native(lib, "[no symbol]") when it has one (PLT stubs, code between functions)
  or cannot be read. Not the nearest exported symbol before it: for internal static functions
  that name would be wrong, and "libcuda.so [stripped]" is what is known;
- in anonymous executable memory (JIT code, trampolines): Frame.other("[anon]"); in a kernel
  pseudo-mapping: its name, e.g. Frame.other("[vdso]");
- outside every executable mapping: Frame.other("[unknown]").
`collapse_unsymbolized` folds a run of such frames of one library into one. The exact address
is still named by `NativeSymbolizer.exact_name` (kernels named from a host stub: one name per stub).
"""

from __future__ import annotations

import os
import re
from bisect import bisect_right
from collections.abc import Iterable
from dataclasses import dataclass

from stacklens.cct import Frame
from stacklens.introspect.demangle import demangle
from stacklens.introspect.elf import ElfFile, SymbolTable
from stacklens.errors import NoSuchProcess
from stacklens.introspect.procfs import Mapping, ProcFS


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


def find_libraries(pid: int, pattern: re.Pattern[str], proc: str | None = None,
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


STRIPPED = "[stripped]"
NO_SYMBOL = "[no symbol]"
UNSYMBOLIZED = (STRIPPED, NO_SYMBOL)
ANON = Frame.other("[anon]")
UNKNOWN = Frame.other("[unknown]")
CACHE_MAX = 1 << 16  # addresses remembered per process and cache

_TABLES: dict[tuple, tuple[SymbolTable | None, str]] = {}


def _file_symbols(host_path: str) -> tuple[SymbolTable | None, str]:
    """(cached symbol table or None if unreadable, the name of an address no symbol covers),
    keyed by (dev, inode, mtime)."""
    try:
        st = os.stat(host_path)
    except OSError:
        return None, NO_SYMBOL
    key = (st.st_dev, st.st_ino, st.st_mtime_ns)
    if key not in _TABLES:
        try:
            with ElfFile(host_path) as elf:
                _TABLES[key] = (SymbolTable(elf), NO_SYMBOL if ".symtab" in elf.sections else STRIPPED)
        except Exception:
            _TABLES[key] = (None, NO_SYMBOL)
    return _TABLES[key]


def is_unsymbolized(f: Frame) -> bool:
    """A native frame that names its library only (no symbol covered the address)."""
    return f.kind == "native" and f.name in UNSYMBOLIZED


def collapse_unsymbolized(frames: Iterable[Frame]) -> tuple[Frame, ...]:
    """Frames (either order) with each run of equal unsymbolized frames (one library, no symbol)
    as one: how deep a library's internals went says nothing without their names."""
    out: list[Frame] = []
    for f in frames:
        if not (out and f == out[-1] and is_unsymbolized(f)):
            out.append(f)
    return tuple(out)


class NativeSymbolizer:
    """Address -> Frame for one process: Frame.native(lib, symbol), or for an address no symbol
    covers the frame of its library or memory (see the module docstring). Answers are cached per
    address (up to CACHE_MAX addresses, then the cache starts again: a sample's leaf can be any
    instruction)."""

    def __init__(self, pid: int, proc: str | None = None):
        self.pid = pid
        self.proc = proc
        self._procfs = ProcFS(proc)
        self._maps: list[Mapping] = []
        self._starts: list[int] = []
        self._cache: dict[int, Frame] = {}
        self._exact: dict[int, str] = {}
        self._unsymbolized: dict[tuple[str, str], Frame] = {}  # one frame object per (lib, name)
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

    def _mapping(self, addr: int) -> Mapping | None:
        m = self._find(addr)
        if m is None:
            self.refresh()  # mapped since the last read (dlopen)
            m = self._find(addr)
        return m

    def mapping(self, addr: int) -> Mapping | None:
        """The executable mapping at `addr` (re-reading the maps once when none is), or None."""
        return self._mapping(addr)

    def known_mapping(self, addr: int) -> Mapping | None:
        """The executable mapping at `addr` as last read, or None (never re-reads the maps)."""
        return self._find(addr)

    def host_path(self, path: str) -> str:
        """Where the target's file `path` is readable from here (through /proc/PID/root)."""
        return str(self._procfs.target_path(self.pid, path))

    def _lookup(self, m: Mapping, addr: int) -> tuple[str, int, str | None, str]:
        """(library basename, file offset, symbol or None, what to call it without one)."""
        file_off = addr - m.start + m.offset
        host = str(self._procfs.target_path(self.pid, m.path.removesuffix(" (deleted)")))
        table, unsymbolized = _file_symbols(host)
        name = None if table is None else table.lookup_offset(file_off)
        return os.path.basename(m.path), file_off, name, unsymbolized

    def frame(self, addr: int) -> Frame:
        f = self._cache.get(addr)
        if f is not None:
            return f
        m = self._mapping(addr)
        if m is None:
            f = UNKNOWN
        elif not m.path.startswith("/"):
            f = Frame.other(m.path) if m.path.startswith("[") else ANON
        else:
            lib, _, name, unsymbolized = self._lookup(m, addr)
            if name is not None:
                f = Frame.native(lib, demangle(name))  # cached there
            else:
                f = self._unsymbolized.get((lib, unsymbolized))
                if f is None:
                    f = self._unsymbolized[(lib, unsymbolized)] = Frame.native(lib, unsymbolized)
        if len(self._cache) >= CACHE_MAX:
            self._cache.clear()
        self._cache[addr] = f
        return f

    def exact_name(self, addr: int) -> str:
        """The symbol at `addr`, or a name for the address itself: "0x<file offset>" in a file,
        "anon 0x<addr>" / "[vdso] 0x<addr>" in memory without a file, "unknown 0x<addr>" outside
        every executable mapping. For what must stay apart per address (a kernel named from its
        host stub); never a CCT frame (see the module docstring). Cached like `frame`."""
        s = self._exact.get(addr)
        if s is not None:
            return s
        m = self._mapping(addr)
        if m is None:
            s = f"unknown 0x{addr:x}"
        elif not m.path.startswith("/"):
            s = f"{m.path or 'anon'} 0x{addr:x}"
        else:
            _, file_off, name, _ = self._lookup(m, addr)
            s = f"0x{file_off:x}" if name is None else demangle(name)
        if len(self._exact) >= CACHE_MAX:
            self._exact.clear()
        self._exact[addr] = s
        return s
