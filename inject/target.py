"""Find the CPython runtime inside a target and read its version from the target itself.

Order: the ``Py_Version`` constant in the target's memory (3.11+), the ``_Py_DebugOffsets``
header at ``_PyRuntime`` (3.13+), then the version in the libpython / executable file name (3.10).
Needs read access to /proc/PID/maps and the target's memory (root / CAP_SYS_PTRACE).
"""

from __future__ import annotations

import os
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import NoSuchProcess, NotApplicable, PermissionDenied
from stacklens.introspect.elf import ElfFile
from .memory import ProcessMemory, RemoteMemory
from stacklens.introspect.procfs import Mapping, ProcFS

WANTED = frozenset({"Py_AddPendingCall", "PyRun_SimpleString", "Py_Version", "_PyRuntime"})
_LIB_RE = re.compile(r"libpython(\d)\.(\d+)t?\.so")
_EXE_RE = re.compile(r"python(\d)\.(\d+)t?$")


@dataclass(frozen=True)
class TargetPython:
    pid: int
    version: tuple[int, int, int]
    version_source: str
    binary: str                      # path of the object holding the runtime, as the target sees it
    bias: int
    symbols: dict[str, int] = field(default_factory=dict)   # runtime addresses
    runtime_section: tuple[int, int] | None = None           # .PyRuntime (address, size)

    @property
    def minor(self) -> tuple[int, int]:
        return self.version[:2]


def _candidates(procfs: ProcFS, pid: int, maps: list[Mapping]) -> list[str]:
    paths: list[str] = []
    for m in maps:
        base = os.path.basename(m.path.removesuffix(" (deleted)"))
        if _LIB_RE.search(base) and m.path not in paths:
            paths.append(m.path)
    try:
        exe = os.readlink(procfs.root / str(pid) / "exe")
    except FileNotFoundError:
        raise NoSuchProcess(f"no process with PID {pid}") from None
    except PermissionError:
        raise PermissionDenied(
            f"cannot inspect PID {pid} (/proc/{pid}/exe): run stacklens as root with CAP_SYS_PTRACE "
            "(the target belongs to another user)") from None
    except OSError:
        exe = ""
    for m in maps:
        if m.path and (m.path.removesuffix(" (deleted)") == exe.removesuffix(" (deleted)")) and m.path not in paths:
            paths.append(m.path)
    return paths


def find_python(pid: int, procfs: ProcFS | None = None, mem: ProcessMemory | None = None) -> TargetPython:
    procfs = procfs or ProcFS()
    mem = mem or RemoteMemory(pid)
    maps = procfs.maps(pid)
    if not maps:
        try:
            os.readlink(procfs.root / str(pid) / "exe")
        except PermissionError:
            raise PermissionDenied(
                f"cannot read the memory map of PID {pid}: run stacklens as root with CAP_SYS_PTRACE "
                "(the target belongs to another user)") from None
        except OSError:
            raise NotApplicable(f"PID {pid} has no user memory (kernel thread or zombie)") from None
        raise PermissionDenied(f"the memory map of PID {pid} reads empty: run stacklens with CAP_SYS_PTRACE")
    for path in _candidates(procfs, pid, maps):
        mine = [m for m in maps if m.path == path]
        elf = ElfFile(procfs.open_mapped_file(pid, mine[0]), error=NotApplicable)
        try:
            syms = elf.symbols(WANTED)
            if "_PyRuntime" not in syms and "Py_AddPendingCall" not in syms:
                continue
            bias = elf.load_bias(mine)
            sec = elf.sections.get(".PyRuntime")
        finally:
            elf.close()
        addrs = {k: v + bias for k, v in syms.items()}
        version, source = _read_version(mem, addrs, path)
        return TargetPython(pid, version, source, path.removesuffix(" (deleted)"), bias, addrs,
                            (sec.addr + bias, sec.size) if sec else None)
    comm = procfs.comm(pid)
    raise NotApplicable(
        f"PID {pid} ({comm}) is not a CPython process: no libpython or Python executable with "
        "_PyRuntime is mapped; pick the PID of the Python interpreter (`stacklens ps`)")


def _read_version(mem: ProcessMemory, addrs: dict[str, int], path: str) -> tuple[tuple[int, int, int], str]:
    if "Py_Version" in addrs:
        hexv = struct.unpack("<Q", mem.read(addrs["Py_Version"], 8))[0]
        return ((hexv >> 24) & 0xFF, (hexv >> 16) & 0xFF, (hexv >> 8) & 0xFF), "Py_Version"
    if "_PyRuntime" in addrs:
        head = mem.read(addrs["_PyRuntime"], 16)
        if head[:8] == b"xdebugpy":
            hexv = struct.unpack_from("<Q", head, 8)[0]
            return ((hexv >> 24) & 0xFF, (hexv >> 16) & 0xFF, (hexv >> 8) & 0xFF), "_Py_DebugOffsets"
    base = os.path.basename(path.removesuffix(" (deleted)"))
    m = _LIB_RE.search(base) or _EXE_RE.search(base)
    if m:
        return (int(m.group(1)), int(m.group(2)), 0), "file name"
    raise NotApplicable(f"cannot tell the CPython version of {path}")


def resolve_in_target(procfs: ProcFS, pid: int, path: str) -> Path:
    return procfs.target_path(pid, path)
