"""Find the CPython runtime inside a target and read its version from the target itself.

The one CPython locator (`find_python`), used by the Python-stack reader
(pystacks/python_process.py), the injector (inject/injector.py) and held programs (cli/held.py),
whose version fallback reads the `_Py_DebugOffsets` header through introspect/debug_offsets.py.
Nothing here picks a layout: introspect/python_layouts.py does, from the version.

Version order: the ``Py_Version`` constant in the target's memory (3.11+), the
``_Py_DebugOffsets`` header at ``_PyRuntime`` (3.13+), then the version in the libpython /
executable file name (3.10).

Needs read access to /proc/PID/maps, the target's files (map_files or its root) and its memory
(root / CAP_SYS_PTRACE). Costs one ELF symbol lookup per candidate file (milliseconds for
libpython) and one or two 8-byte reads.
"""

from __future__ import annotations

import re
import struct
from collections.abc import Collection
from dataclasses import dataclass, field

from stacklens.errors import MemoryReadError, NotApplicable, PermissionDenied
from stacklens.introspect.debug_offsets import DEBUG_HEADER, parse_debug_header
from stacklens.introspect.elf import ElfFile
from stacklens.introspect.memory import ProcessMemory, ProcMem, read_u64
from stacklens.introspect.procfs import Mapping, ProcFS

# what both sides need from the file that holds the runtime
RUNTIME_SYMBOLS = frozenset({"_PyRuntime", "Py_Version", "PyCode_Type", "Py_AddPendingCall",
                             "PyRun_SimpleString"})
_NAME_RE = re.compile(r"(?:^|/)(lib)?python(\d+)\.(\d+)(t?)(?:d|m)?(?:\.so[.\d]*)?$")

@dataclass(frozen=True)
class PythonTarget:
    pid: int
    path: str                        # the object holding the runtime, as the target's maps name it
    host_path: str                   # where it was opened from here (map_files, the target's root)
    version: tuple[int, int, int]
    version_source: str              # "Py_Version" | "_Py_DebugOffsets" | "file name"
    hexversion: int                  # PY_VERSION_HEX; 0 when only the file name told the version
    bias: int                        # load bias: runtime address = bias + st_value
    symbols: dict[str, int] = field(default_factory=dict)   # runtime addresses
    runtime_section: tuple[int, int] | None = None           # .PyRuntime (address, size)
    name_version: tuple[int, int] | None = None              # what the file name says, if anything
    free_threaded: bool = False      # the file name says so (python3.13t)

    @property
    def minor(self) -> tuple[int, int]:
        return self.version[:2]

    @property
    def binary(self) -> str:
        """The path of the object holding the runtime, as the target sees it."""
        return self.path.removesuffix(" (deleted)")


def _name_version(path: str) -> tuple[tuple[int, int] | None, bool, bool]:
    """(version, free-threaded, is a libpython) as the file name tells them."""
    m = _NAME_RE.search(path.removesuffix(" (deleted)"))
    if not m:
        return None, False, False
    return (int(m.group(2)), int(m.group(3))), m.group(4) == "t", bool(m.group(1))


def _candidates(maps: list[Mapping], exe: str) -> list[str]:
    """Mapped files that may hold the runtime: libpython first (a python3.X executable linked
    against it has no _PyRuntime of its own), then python-named files, then the executable."""
    seen: set[str] = set()
    named: list[str] = []
    for m in maps:
        if m.path and m.path not in seen and _name_version(m.path)[0] is not None:
            seen.add(m.path)
            named.append(m.path)
    out = sorted(named, key=lambda p: not _name_version(p)[2])
    exe = exe.removesuffix(" (deleted)")
    for m in maps:
        if exe and m.path not in seen and m.path.removesuffix(" (deleted)") == exe:
            seen.add(m.path)
            out.append(m.path)
    return out


def _open_elf(procfs: ProcFS, pid: int, mapping: Mapping) -> tuple[ElfFile, str] | None:
    for host in procfs.mapped_file_candidates(pid, mapping):
        try:
            return ElfFile(host, error=NotApplicable), host
        except NotApplicable:
            continue
    return None


def find_python(pid: int, procfs: ProcFS | None = None, mem: ProcessMemory | None = None, *,
                symbols: Collection[str] = ()) -> PythonTarget:
    """Locate the object that holds `_PyRuntime` in ``pid`` and tell its version.

    ``symbols``: more names to look up in that object (runtime addresses in ``.symbols`` when it
    defines them). ``mem`` reads the version; by default /proc/PID/mem, opened and closed here.
    Raises NoSuchProcess, PermissionDenied, or NotApplicable (not a CPython process)."""
    procfs = procfs or ProcFS()
    maps = procfs.maps(pid)
    if not maps:
        try:
            exe = procfs.exe_strict(pid)
        except PermissionDenied:
            raise PermissionDenied(
                f"cannot read the memory map of PID {pid}: run stacklens as root with CAP_SYS_PTRACE "
                "(the target belongs to another user)") from None
        if not exe:
            raise NotApplicable(f"PID {pid} has no user memory (kernel thread or zombie)")
        raise PermissionDenied(f"the memory map of PID {pid} reads empty: run stacklens with CAP_SYS_PTRACE")
    wanted = RUNTIME_SYMBOLS | frozenset(symbols)
    for path in _candidates(maps, procfs.exe_strict(pid)):
        mine = [m for m in maps if m.path == path]
        opened = _open_elf(procfs, pid, mine[0])
        if opened is None:
            continue
        elf, host = opened
        with elf:
            syms = elf.symbols(wanted)
            if "_PyRuntime" not in syms and "Py_AddPendingCall" not in syms:
                continue
            bias = elf.load_bias(mine)
            sec = elf.sections.get(".PyRuntime")
        addrs = {k: v + bias for k, v in syms.items()}
        name_version, free_threaded, _ = _name_version(path)
        own = mem is None
        mem = mem or ProcMem(pid, procfs)
        try:
            version, hexversion, source = _read_version(mem, addrs, name_version, path)
        finally:
            if own:
                mem.close()  # type: ignore[attr-defined]
        return PythonTarget(pid, path, host, version, source, hexversion, bias, addrs,
                            (sec.addr + bias, sec.size) if sec else None, name_version, free_threaded)
    raise NotApplicable(
        f"PID {pid} ({procfs.comm(pid)}) is not a CPython process: no libpython or Python executable "
        "with _PyRuntime is mapped; pick the PID of the Python interpreter (`stacklens ps`)")


def _read_version(mem: ProcessMemory, addrs: dict[str, int], name_version: tuple[int, int] | None,
                  path: str) -> tuple[tuple[int, int, int], int, str]:
    if "Py_Version" in addrs:       # const unsigned long = PY_VERSION_HEX
        hexv = read_u64(mem, addrs["Py_Version"]) & 0xFFFFFFFF
        return ((hexv >> 24) & 0xFF, (hexv >> 16) & 0xFF, (hexv >> 8) & 0xFF), hexv, "Py_Version"
    if "_PyRuntime" in addrs:
        try:
            head = parse_debug_header(mem.read(addrs["_PyRuntime"], DEBUG_HEADER.size))
        except MemoryReadError:
            head = None
        if head is not None:
            hexv = head.hexversion
            return ((hexv >> 24) & 0xFF, (hexv >> 16) & 0xFF, (hexv >> 8) & 0xFF), hexv, "_Py_DebugOffsets"
    if name_version is not None:
        return (*name_version, 0), 0, "file name"
    raise NotApplicable(f"cannot tell the CPython version of {path} (no Py_Version symbol, unusual name)")


__all__ = ["PythonTarget", "RUNTIME_SYMBOLS", "find_python"]
