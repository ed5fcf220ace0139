"""Injector for CPython 3.14+: the PEP 768 remote-debugging protocol, written by us.

Needs CAP_SYS_PTRACE (process_vm_writev) but never stops the target. We do what
``sys.remote_exec`` does (Python/remote_debugging.c) from any daemon Python version: read
``_Py_DebugOffsets`` at the start of the target's ``_PyRuntime`` (its header through
``introspect.debug_offsets.parse_debug_header``, the one reader of it), find the main thread state,
write the script path into its ``_PyRemoteDebuggerSupport``, set ``debugger_pending_call`` and
the eval-breaker "please stop" bit (where those fields sit: ``remote_debug`` in the one version
table, ``introspect/python_layouts.py``). The main thread runs the script at its next eval-breaker
check. A target started with ``PYTHON_DISABLE_REMOTE_DEBUG`` / ``-X disable_remote_debug`` has
``config.remote_debug == 0``: we refuse (the user opted out) with a clear error.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from stacklens.errors import AttachError, UnsupportedVersion
from stacklens.introspect.debug_offsets import DEBUG_HEADER, parse_debug_header
from stacklens.introspect.memory import ProcessMemory, WritableMemory, read_u64
from stacklens.introspect.python_layouts import REMOTE_DEBUG_SUPPORTED, RemoteDebugLayout, remote_debug_layouts

EVAL_PLEASE_STOP_BIT = 1 << 5


def _plausible(mem: ProcessMemory, runtime_addr: int, L: RemoteDebugLayout) -> bool:
    try:
        eb, support, enabled, pending_off, path_off, size = struct.unpack(
            "<6Q", mem.read(runtime_addr + L.dbg_eval_breaker, 48))
    except OSError:                       # MemoryReadError: not mapped there
        return False
    return (size == 512 and pending_off < path_off <= 64 and 0 < eb < 4096 and 0 < support < 1 << 16
            and 0 < enabled < 1 << 20)


@dataclass(frozen=True)
class RemoteExecTarget:
    tstate: int
    pending_addr: int
    path_addr: int
    path_size: int
    eval_breaker_addr: int
    free_threaded: bool


def locate(mem: ProcessMemory, runtime_addr: int, pid: int) -> RemoteExecTarget:
    head = parse_debug_header(mem.read(runtime_addr, DEBUG_HEADER.size))
    if head is None:
        raise AttachError(f"PID {pid}: no _Py_DebugOffsets cookie at _PyRuntime {runtime_addr:#x}")
    minor, free_threaded = head.version, head.free_threaded
    candidates = remote_debug_layouts(minor)
    if not candidates:
        raise UnsupportedVersion(
            f"PID {pid} runs CPython {minor[0]}.{minor[1]}, whose remote-debugging layout stacklens "
            f"does not know (known: {', '.join('%d.%d' % k for k in REMOTE_DEBUG_SUPPORTED)}); "
            "upgrade stacklens")
    layout = next((L for L in candidates if _plausible(mem, runtime_addr, L)), None)
    if layout is None:
        raise UnsupportedVersion(f"PID {pid}: this CPython {minor[0]}.{minor[1]} build's _Py_DebugOffsets "
                                 "matches no known layout; upgrade stacklens")
    off = lambda field: read_u64(mem, runtime_addr + getattr(layout, field))  # noqa: E731
    path_size = off("dbg_script_path_size")
    if read_u64(mem, runtime_addr + off("runtime_finalizing")) != 0:
        raise AttachError(f"PID {pid} is shutting down (interpreter finalizing)")
    interp = read_u64(mem, runtime_addr + off("runtime_interpreters_head"))
    if interp == 0:
        raise AttachError(f"PID {pid} has no interpreter yet; retry when it has started")
    enabled = struct.unpack("<i", mem.read(interp + off("dbg_remote_debugging_enabled"), 4))[0]
    if enabled != 1:
        raise AttachError(
            f"PID {pid} disabled remote debugging (PYTHON_DISABLE_REMOTE_DEBUG or "
            "-X disable_remote_debug, or built --without-remote-debug): stacklens respects that; "
            "restart the job without it to profile it")
    tstate = read_u64(mem, interp + read_u64(mem, runtime_addr + layout.interp_threads_main))
    if tstate == 0:
        raise AttachError(f"PID {pid} has no main thread state (main thread exited?)")
    support = tstate + off("dbg_remote_debugger_support")
    return RemoteExecTarget(tstate, support + off("dbg_pending_call"), support + off("dbg_script_path"),
                            path_size, tstate + off("dbg_eval_breaker"), bool(free_threaded))


def request_exec(mem: WritableMemory, runtime_addr: int, pid: int, script_path: str) -> RemoteExecTarget:
    """Ask the target's main thread to run ``script_path`` (a path in the target's namespace)."""
    tgt = locate(mem, runtime_addr, pid)
    raw = script_path.encode()
    if len(raw) + 1 > tgt.path_size:
        raise AttachError(f"script path too long for PEP 768 ({len(raw)} >= {tgt.path_size}); "
                          "use a shorter socket directory")
    mem.write(tgt.path_addr, raw + b"\0")
    mem.write(tgt.pending_addr, struct.pack("<i", 1))
    eb = read_u64(mem, tgt.eval_breaker_addr)
    mem.write(tgt.eval_breaker_addr, struct.pack("<Q", eb | EVAL_PLEASE_STOP_BIT))
    return tgt


def withdraw(mem: WritableMemory, tgt: RemoteExecTarget) -> None:
    """Cancel a request that has not run yet (the eval-breaker bit left set is harmless)."""
    try:
        mem.write(tgt.pending_addr, struct.pack("<i", 0))
    except OSError:
        pass


def pending(mem: ProcessMemory, tgt: RemoteExecTarget) -> bool:
    return struct.unpack("<i", mem.read(tgt.pending_addr, 4))[0] != 0
