"""Injector for CPython 3.10–3.13: queue ``PyRun_SimpleString(text)`` as a pending call via ptrace.

Requires CAP_SYS_PTRACE (or Yama scope 0 + same uid). Stops the target's main thread once for
~1 ms (attach, one remote ``mmap`` syscall, one call of ``Py_AddPendingCall``, restore, detach).

Why this is safe: the hijacked thread only executes one raw syscall and ``Py_AddPendingCall``,
which CPython documents as callable without the GIL or a thread state (signal-handler style: a
short lock around a fixed-size queue, no allocation). No Python runs in the hijacked thread; the
main thread runs the text later, at its next eval-breaker check, holding the GIL at an instruction
boundary. No breakpoint is written: the call "returns" to address 0 and the resulting SIGSEGV stop
is intercepted and suppressed. Every register (general purpose, orig_rax, the whole XSAVE area) and
the stack bytes below the red zone that the call used are restored before detaching. A thread
stopped inside a restartable syscall keeps its -ERESTART* return value and orig_rax: we run our
code with orig_rax = -1 (no restart processing), and the kernel restarts the original syscall
when the restored registers are resumed.

The bootstrap text lives in one anonymous page mapped in the target (reused on later attaches to
the same process, so at most one page per process stays behind).
"""

from __future__ import annotations

import errno
import signal
import struct
import time
from dataclasses import dataclass
from typing import Callable

from stacklens.errors import AttachError, NoSuchProcess, NotApplicable, Timeout
from stacklens.introspect.cpython import PythonTarget
from stacklens.introspect.memory import RemoteMemory, WritableMemory
from stacklens.introspect.procfs import ProcFS
from stacklens.introspect.ptrace import PtraceError, Regs, Tracee, check_arch

PAGE = 4096
MAGIC = b"STACKLENS-BOOTSTRAP-PAGE-v1".ljust(32, b"\0")
MAGIC_AT = PAGE - len(MAGIC)
MAX_TEXT = MAGIC_AT - 1
NR_MMAP = 9
PROT_READ, PROT_WRITE = 1, 2
MAP_PRIVATE, MAP_ANONYMOUS, MAP_NORESERVE = 0x02, 0x20, 0x4000
STACK_SCRATCH = 8192        # bytes below the red zone that the call may use; saved and restored
RED_ZONE = 128 + 128
NEG1 = (1 << 64) - 1

# pages we mapped, per (pid, process start time); validated by MAGIC before reuse
_PAGES: dict[tuple[int, int], int] = {}


@dataclass(frozen=True)
class PendingCall:
    page: int
    reused_page: bool
    queued: bool              # False: the queue was full but an earlier call on this page is queued
    stop_us: int              # how long the main thread was stopped


def _signed(v: int) -> int:
    return v - (1 << 64) if v >= 1 << 63 else v


def _find_syscall_insn(procfs: ProcFS, mem: WritableMemory, pid: int) -> int:
    """Any executable `0f 05` (syscall) byte pair: single-stepping it runs exactly one syscall."""
    maps = procfs.maps(pid)
    ordered = [m for m in maps if m.path == "[vdso]"] + [
        m for m in maps if "x" in m.perms and "libc" in m.path] + [
        m for m in maps if "x" in m.perms and m.path not in ("[vsyscall]",)]
    for m in ordered:
        if "x" not in m.perms:
            continue
        for off in range(0, min(m.size, 1 << 21), 1 << 16):
            try:
                chunk = mem.read(m.start + off, min(1 << 16, m.size - off) + (1 if off + (1 << 16) < m.size else 0))
            except OSError:
                break
            i = chunk.find(b"\x0f\x05")
            if i >= 0:
                return m.start + off + i
    raise NotApplicable(f"no syscall instruction found in PID {pid}'s executable mappings")


def _stack_mapping_floor(procfs: ProcFS, pid: int, rsp: int) -> int:
    for m in procfs.maps(pid):
        if m.start <= rsp < m.end:
            return m.start
    raise AttachError(f"the main thread's stack pointer {rsp:#x} is not in a mapping")


def queue_pending_call(
    tp: PythonTarget,
    text: bytes,
    *,
    timeout_s: float,
    procfs: ProcFS | None = None,
    mem: WritableMemory | None = None,
    on_step: Callable[[str], None] | None = None,
) -> PendingCall:
    """Queue ``PyRun_SimpleString(text)`` on the target's main thread. Returns once detached."""
    check_arch()
    procfs = procfs or ProcFS()
    mem = mem or RemoteMemory(tp.pid)
    pid = tp.pid
    for sym in ("Py_AddPendingCall", "PyRun_SimpleString"):
        if sym not in tp.symbols:
            raise NotApplicable(f"{tp.binary} does not export {sym}; cannot inject into PID {pid}")
    if len(text) > MAX_TEXT or b"\0" in text:
        raise ValueError("bootstrap text too long or contains NUL")
    status = procfs.status(pid)
    tracer = status.get("TracerPid", "0")
    if tracer != "0":
        raise AttachError(f"PID {pid} is already traced by PID {tracer} (a debugger or profiler); "
                          "detach that tool first")
    state = procfs.thread_state(pid, pid)
    if state in ("Z", "X"):
        raise AttachError(f"the main thread of PID {pid} has exited (state {state}); "
                          "CPython runs pending calls only on the main thread")
    gadget = _find_syscall_insn(procfs, mem, pid)
    key = (pid, procfs.starttime(pid))
    step = on_step or (lambda _s: None)

    deadline = time.monotonic() + timeout_s
    tracee = Tracee(pid, procfs.yama_ptrace_scope())
    saved: Regs | None = None
    fp = None
    stack_save: tuple[int, bytes] | None = None
    stopped = False
    t_stop = 0.0
    try:
        tracee.stop(deadline)
        t_stop = time.monotonic()
        stopped = True
        step("stopped")
        saved = tracee.get_regs()
        fp = tracee.get_fpstate()

        page, reused = _reuse_page(key, mem), True
        if page is None:
            reused = False
            page = _remote_syscall(tracee, saved, gadget, NR_MMAP,
                                   (0, PAGE, PROT_READ | PROT_WRITE,
                                    MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, NEG1, 0), deadline)
            if page < 0:
                raise AttachError(f"mmap in PID {pid} failed: {errno.errorcode.get(-page, page)}")
            _PAGES[key] = page
        step("mapped")
        mem.write(page, text + b"\0")
        mem.write(page + MAGIC_AT, MAGIC)

        sp = ((saved.rsp - RED_ZONE) & ~0xF) - 8      # (sp + 8) % 16 == 0 at function entry
        floor = max(_stack_mapping_floor(procfs, pid, saved.rsp), sp - STACK_SCRATCH)
        stack_save = (floor, mem.read(floor, sp + 8 - floor))
        mem.write(sp, struct.pack("<Q", 0))           # return address 0: the return faults
        rc = _remote_call(tracee, saved, sp, tp.symbols["Py_AddPendingCall"],
                          (tp.symbols["PyRun_SimpleString"], page), deadline, step)
        rc = struct.unpack("<i", struct.pack("<I", rc & 0xFFFFFFFF))[0]   # int in eax
        if rc != 0 and not reused:
            raise AttachError(f"Py_AddPendingCall in PID {pid} returned {rc} (pending-call queue "
                              "full or interpreter finalizing); retry later")
        return PendingCall(page, reused, rc == 0, int((time.monotonic() - t_stop) * 1e6))
    except PtraceError as e:
        if e.errno == errno.ESRCH:
            raise NoSuchProcess(f"PID {pid} exited during attach") from None
        raise AttachError(f"ptrace failed on PID {pid}: {e}") from None
    finally:
        if tracee.attached:
            _restore_and_detach(tracee, mem, saved, fp, stack_save, stopped, step)


def _reuse_page(key: tuple[int, int], mem: WritableMemory) -> int | None:
    page = _PAGES.get(key)
    if page is None:
        return None
    try:
        if mem.read(page + MAGIC_AT, len(MAGIC)) == MAGIC:
            return page
    except OSError:
        pass
    _PAGES.pop(key, None)
    return None


def disarm(pid: int, page: int, mem: WritableMemory | None = None) -> None:
    """Make a queued pending call on ``page`` a no-op (empty text) without stopping the target."""
    try:
        (mem or RemoteMemory(pid)).write(page, b"\0")
    except (OSError, NoSuchProcess):
        pass


def _remote_syscall(tracee: Tracee, saved: Regs, gadget: int, nr: int, args: tuple, deadline: float) -> int:
    r = saved.copy()
    r.rax = nr
    r.rdi, r.rsi, r.rdx, r.r10, r.r8, r.r9 = (a & NEG1 for a in args)
    r.rip = gadget
    r.orig_rax = NEG1          # no syscall-restart processing on our registers
    tracee.set_regs(r)
    tracee.singlestep()
    tracee.wait_for_signal(signal.SIGTRAP, deadline, step=True)
    out = tracee.get_regs()
    if out.rip != gadget + 2:
        raise AttachError(f"remote syscall did not complete (rip {out.rip:#x})")
    return _signed(out.rax)


def _remote_call(tracee: Tracee, saved: Regs, sp: int, func: int, args: tuple, deadline: float,
                 step: Callable[[str], None]) -> int:
    r = saved.copy()
    r.rdi, r.rsi = args
    r.rip = func
    r.rsp = sp
    r.rax = 0
    r.orig_rax = NEG1
    r.eflags &= ~0x400         # DF clear, as the ABI requires at a call
    tracee.set_regs(r)
    tracee.cont()
    step("calling")
    try:
        tracee.wait_for_signal(signal.SIGSEGV, deadline)
    except Timeout:
        # Py_AddPendingCall only blocks acquiring its queue lock (held by this very thread at the
        # moment we stopped it, or contended): nothing changed yet, so abandoning the call is safe.
        tracee.interrupt()
        tracee.stop(time.monotonic() + 2.0)
        raise Timeout(f"PID {tracee.tid}: Py_AddPendingCall did not return in time; "
                      "the call was abandoned and the thread restored; retry") from None
    out = tracee.get_regs()
    if out.rip != 0:
        raise AttachError(f"unexpected fault at {out.rip:#x} while queueing the pending call; "
                          "registers restored")
    return out.rax


def _restore_and_detach(tracee: Tracee, mem: WritableMemory, saved: Regs | None, fp, stack_save,
                        stopped: bool, step: Callable[[str], None]) -> None:
    try:
        if not stopped:
            # attach happened but the stop never came (timeout): stop it to be able to detach
            try:
                tracee.stop(time.monotonic() + 2.0)
            except (Timeout, PtraceError):
                pass
        if saved is not None:
            tracee.set_regs(saved)
        if fp is not None:
            tracee.set_fpstate(fp)
        if stack_save is not None:
            mem.write(stack_save[0], stack_save[1])
        step("restored")
    except (PtraceError, OSError, NoSuchProcess):
        pass
    finally:
        try:
            tracee.detach()
        except PtraceError:
            pass
