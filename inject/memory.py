"""Reading and writing another process's memory through one interface (py-spy's ProcessMemory).

Requires CAP_SYS_PTRACE (or same uid under Yama scope 0). ``process_vm_readv/writev`` never stop
the target; ``write_force`` uses /proc/PID/mem, which can write read-only pages (FOLL_FORCE).
"""

from __future__ import annotations

import ctypes
import errno
import os
import struct
from typing import Protocol

from ..errors import NoSuchProcess, PermissionDenied


PAGE = 4096


class ProcessMemory(Protocol):
    def read(self, addr: int, n: int) -> bytes: ...
    def write(self, addr: int, data: bytes) -> None: ...


def read_cstring(mem: ProcessMemory, addr: int, max_len: int) -> bytes:
    """The NUL-terminated string at ``addr`` (without the NUL), at most ``max_len`` bytes, read
    page by page so that it never reads past the page where the NUL is. Raises what ``mem.read``
    raises when the first page is unreadable; an unreadable later page ends the string there."""
    parts = []
    got = 0
    while got < max_len:
        n = min(PAGE - addr % PAGE, max_len - got)
        try:
            chunk = mem.read(addr, n)
        except (OSError, NoSuchProcess, PermissionDenied):
            if not parts:
                raise
            break                         # readable start, unmapped tail: keep what we have
        z = chunk.find(b"\0")
        if z >= 0:
            parts.append(chunk[:z])
            break
        parts.append(chunk)
        got += n
        addr += n
    return b"".join(parts)


class ProcMemReader:
    """Reads through an open ``/proc/PID/mem`` fd (``os.pread``); the caller owns and closes the
    fd. Unlike ``RemoteMemory`` (process_vm_readv by PID) the fd stays bound to the address space
    it was opened on: once the target exits or execs, reads fail, even if its PID is reused."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def read(self, addr: int, n: int) -> bytes:
        try:
            data = os.pread(self.fd, n, addr)
        except (OverflowError, ValueError):
            raise OSError(errno.EINVAL, f"bad address {addr!r}") from None
        if len(data) != n:
            raise OSError(errno.EFAULT, f"short read at {addr:#x}: {len(data)}/{n}")
        return data


class _IOVec(ctypes.Structure):
    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


_libc = ctypes.CDLL(None, use_errno=True)
_libc.process_vm_readv.restype = ctypes.c_ssize_t
_libc.process_vm_readv.argtypes = [ctypes.c_int, ctypes.POINTER(_IOVec), ctypes.c_ulong,
                                   ctypes.POINTER(_IOVec), ctypes.c_ulong, ctypes.c_ulong]
_libc.process_vm_writev.restype = ctypes.c_ssize_t
_libc.process_vm_writev.argtypes = _libc.process_vm_readv.argtypes


def _raise_for(err: int, pid: int, what: str) -> None:
    if err == errno.ESRCH:
        raise NoSuchProcess(f"PID {pid} exited ({what})")
    if err == errno.EPERM:
        raise PermissionDenied(
            f"{what} of PID {pid}: permission denied; run as root / with CAP_SYS_PTRACE "
            "(and check /proc/sys/kernel/yama/ptrace_scope)")
    raise OSError(err, f"{what} of PID {pid} failed: {os.strerror(err)}")


class RemoteMemory:
    def __init__(self, pid: int) -> None:
        self.pid = pid

    def read(self, addr: int, n: int) -> bytes:
        buf = ctypes.create_string_buffer(n)
        local = _IOVec(ctypes.cast(buf, ctypes.c_void_p), n)
        remote = _IOVec(addr, n)
        got = _libc.process_vm_readv(self.pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
        if got < 0:
            _raise_for(ctypes.get_errno(), self.pid, f"reading {n} bytes at {addr:#x}")
        if got != n:
            raise OSError(errno.EFAULT, f"short read at {addr:#x} of PID {self.pid}: {got}/{n}")
        return buf.raw

    def write(self, addr: int, data: bytes) -> None:
        buf = ctypes.create_string_buffer(data, len(data))
        local = _IOVec(ctypes.cast(buf, ctypes.c_void_p), len(data))
        remote = _IOVec(addr, len(data))
        got = _libc.process_vm_writev(self.pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
        if got < 0:
            _raise_for(ctypes.get_errno(), self.pid, f"writing {len(data)} bytes at {addr:#x}")
        if got != len(data):
            raise OSError(errno.EFAULT, f"short write at {addr:#x} of PID {self.pid}")

    def read_u64(self, addr: int) -> int:
        return struct.unpack("<Q", self.read(addr, 8))[0]


class FakeMemory:
    """Sparse local memory for tests: ``FakeMemory({addr: bytes, ...})``."""

    def __init__(self, regions: dict[int, bytes | bytearray] | None = None) -> None:
        self.regions = {a: bytearray(b) for a, b in (regions or {}).items()}
        self.writes: list[tuple[int, bytes]] = []

    def _find(self, addr: int, n: int) -> tuple[bytearray, int]:
        for base, buf in self.regions.items():
            if base <= addr and addr + n <= base + len(buf):
                return buf, addr - base
        raise OSError(errno.EFAULT, f"fake memory: {addr:#x}+{n} unmapped")

    def read(self, addr: int, n: int) -> bytes:
        buf, off = self._find(addr, n)
        return bytes(buf[off:off + n])

    def write(self, addr: int, data: bytes) -> None:
        buf, off = self._find(addr, len(data))
        buf[off:off + len(data)] = data
        self.writes.append((addr, bytes(data)))

    def read_u64(self, addr: int) -> int:
        return struct.unpack("<Q", self.read(addr, 8))[0]
