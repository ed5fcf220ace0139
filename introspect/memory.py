"""Reading and writing another process's memory through one interface (py-spy's ProcessMemory).

Every read of a target's memory, by the BPF side (the Python-stack reader, code-object
symbolization) and by the injector and agent server (runtime lookup, PEP 768, kernel names of raw
CUPTI records), goes through `ProcessMemory`. A failed read raises `MemoryReadError` (an
`OSError` too); a process that is gone or forbidden raises `NoSuchProcess` / `PermissionDenied`.
Fakes in local memory: tests/fakes/memory.py.

Requires CAP_SYS_PTRACE (or same uid under Yama scope 0). Neither implementation stops the
target: `ProcMem` preads /proc/PID/mem (the fd stays bound to the address space it was opened
on); `RemoteMemory` uses process_vm_readv/writev by PID (and is the one that writes).
"""

from __future__ import annotations

import ctypes
import errno
import os
import struct
from typing import Protocol

from stacklens.errors import MemoryReadError, NoSuchProcess, PermissionDenied
from stacklens.introspect.procfs import ProcFS

PAGE = 4096


class ProcessMemory(Protocol):
    def read(self, addr: int, n: int) -> bytes:
        """Exactly ``n`` bytes at ``addr`` of the target, or raise MemoryReadError."""
        ...


class WritableMemory(ProcessMemory, Protocol):
    def write(self, addr: int, data: bytes) -> None: ...


def read_u64(mem: ProcessMemory, addr: int) -> int:
    return struct.unpack("<Q", mem.read(addr, 8))[0]


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


class ProcMem:
    """`ProcessMemory` over /proc/PID/mem (pread; no ptrace stop needed as root), the one
    /proc/PID/mem reader. Opened at construction (NoSuchProcess / PermissionDenied); ``close()``
    releases the fd (also a context manager)."""

    def __init__(self, pid: int, procfs: ProcFS | None = None) -> None:
        self.pid = pid
        self._fd = -1
        self._fd = (procfs or ProcFS()).open_mem(pid)

    def read(self, addr: int, n: int) -> bytes:
        try:
            data = os.pread(self._fd, n, addr)
        except OSError as e:
            raise MemoryReadError(f"read {n} bytes at {addr:#x} in pid {self.pid}: {e}",
                                  e.errno or errno.EFAULT) from e
        except (OverflowError, ValueError) as e:
            raise MemoryReadError(f"read {n} bytes at {addr!r} in pid {self.pid}: {e}",
                                  errno.EINVAL) from e
        if len(data) != n:
            raise MemoryReadError(f"short read at {addr:#x} in pid {self.pid}: {len(data)}/{n}")
        return data

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> ProcMem:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:  # best effort
        try:
            self.close()
        except Exception:
            pass


class IOVec(ctypes.Structure):
    """struct iovec: process_vm_readv/writev here, PTRACE_GETREGSET in introspect/ptrace.py."""

    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


_libc = ctypes.CDLL(None, use_errno=True)
_libc.process_vm_readv.restype = ctypes.c_ssize_t
_libc.process_vm_readv.argtypes = [ctypes.c_int, ctypes.POINTER(IOVec), ctypes.c_ulong,
                                   ctypes.POINTER(IOVec), ctypes.c_ulong, ctypes.c_ulong]
_libc.process_vm_writev.restype = ctypes.c_ssize_t
_libc.process_vm_writev.argtypes = _libc.process_vm_readv.argtypes


def _raise_for(err: int, pid: int, what: str, error: type[OSError]) -> None:
    if err == errno.ESRCH:
        raise NoSuchProcess(f"PID {pid} exited ({what})")
    if err == errno.EPERM:
        raise PermissionDenied(
            f"{what} of PID {pid}: permission denied; run as root / with CAP_SYS_PTRACE "
            "(and check /proc/sys/kernel/yama/ptrace_scope)")
    if error is MemoryReadError:
        raise MemoryReadError(f"{what} of PID {pid} failed: {os.strerror(err)}", err)
    raise OSError(err, f"{what} of PID {pid} failed: {os.strerror(err)}")


class RemoteMemory:
    """`WritableMemory` by PID through process_vm_readv/writev: what the injector writes with
    (PEP 768 requests, the pending-call page) without stopping the target."""

    def __init__(self, pid: int) -> None:
        self.pid = pid

    def read(self, addr: int, n: int) -> bytes:
        buf = ctypes.create_string_buffer(n)
        local = IOVec(ctypes.cast(buf, ctypes.c_void_p), n)
        remote = IOVec(addr, n)
        got = _libc.process_vm_readv(self.pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
        if got < 0:
            _raise_for(ctypes.get_errno(), self.pid, f"reading {n} bytes at {addr:#x}", MemoryReadError)
        if got != n:
            raise MemoryReadError(f"short read at {addr:#x} of PID {self.pid}: {got}/{n}")
        return buf.raw

    def write(self, addr: int, data: bytes) -> None:
        buf = ctypes.create_string_buffer(data, len(data))
        local = IOVec(ctypes.cast(buf, ctypes.c_void_p), len(data))
        remote = IOVec(addr, len(data))
        got = _libc.process_vm_writev(self.pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
        if got < 0:
            _raise_for(ctypes.get_errno(), self.pid, f"writing {len(data)} bytes at {addr:#x}", OSError)
        if got != len(data):
            raise OSError(errno.EFAULT, f"short write at {addr:#x} of PID {self.pid}")
