"""The one ptrace binding (Linux x86_64): the requests the injector (inject/ptrace_inject.py, a
seized `Tracee`) and held programs (cli/held.py, a PTRACE_TRACEME child) need.

Requires CAP_SYS_PTRACE or same uid + Yama scope 0/1-with-ancestry (a traced child of our own:
any scope below 3). All requests for one tracee must come from the OS thread that seized it.
Cost: one system call per request.
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform
import signal
import time

from stacklens.errors import NoSuchProcess, PermissionDenied, Timeout, UnsupportedVersion
from stacklens.introspect.memory import IOVec

PTRACE_PEEKTEXT = 1
PTRACE_PEEKUSER = 3
PTRACE_POKETEXT = 4
PTRACE_POKEUSER = 6
PTRACE_CONT = 7
PTRACE_SINGLESTEP = 9
PTRACE_GETREGS = 12
PTRACE_SETREGS = 13
PTRACE_DETACH = 17
PTRACE_SETOPTIONS = 0x4200
PTRACE_GETREGSET = 0x4204
PTRACE_SETREGSET = 0x4205
PTRACE_SEIZE = 0x4206
PTRACE_INTERRUPT = 0x4207
PTRACE_O_TRACEEXEC = 0x10
PTRACE_O_EXITKILL = 0x100000
PTRACE_EVENT_EXEC = 4
PTRACE_EVENT_STOP = 128
NT_X86_XSTATE = 0x202
NT_PRFPREG = 2
WALL = 0x40000000


class Regs(ctypes.Structure):
    """struct user_regs_struct (x86_64)."""

    _fields_ = [(n, ctypes.c_ulonglong) for n in (
        "r15", "r14", "r13", "r12", "rbp", "rbx", "r11", "r10", "r9", "r8", "rax", "rcx", "rdx",
        "rsi", "rdi", "orig_rax", "rip", "cs", "eflags", "rsp", "ss", "fs_base", "gs_base",
        "ds", "es", "fs", "gs")]

    def copy(self) -> "Regs":
        r = Regs()
        ctypes.memmove(ctypes.byref(r), ctypes.byref(self), ctypes.sizeof(Regs))
        return r


_libc = ctypes.CDLL(None, use_errno=True)
_libc.ptrace.restype = ctypes.c_long
_libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]


def check_arch() -> None:
    if platform.machine() != "x86_64":
        raise UnsupportedVersion(
            f"the ptrace injector supports x86_64 only (this is {platform.machine()}); "
            "use a CPython 3.14 target (PEP 768) instead")


class PtraceError(OSError):
    pass


def call(req: int, tid: int, addr: int | None = 0, data: object = 0) -> int:
    """One ptrace request; the kernel's result (signed), PtraceError on failure."""
    ctypes.set_errno(0)
    rc = _libc.ptrace(req, tid, addr, data)
    if rc == -1:
        err = ctypes.get_errno()
        if err:
            raise PtraceError(err, f"ptrace({req:#x}, {tid}): {os.strerror(err)}")
    return rc


class Tracee:
    """One seized thread. Use ``stop()``; always ``detach()`` in a finally."""

    def __init__(self, tid: int, yama_scope: int | None = None) -> None:
        self.tid = tid
        self.attached = False
        self.pending_signals: list[int] = []   # signals we intercepted, re-delivered on detach
        try:
            call(PTRACE_SEIZE, tid, 0, 0)
        except PtraceError as e:
            if e.errno == errno.ESRCH:
                raise NoSuchProcess(f"thread {tid} exited before it could be attached") from None
            if e.errno == errno.EPERM:
                why = ""
                if yama_scope is not None and yama_scope > 0:
                    why = (f" (Yama ptrace_scope={yama_scope}: "
                           + {1: "only descendants unless CAP_SYS_PTRACE",
                              2: "CAP_SYS_PTRACE required",
                              3: "ptrace disabled until reboot"}.get(yama_scope, "restricted") + ")")
                raise PermissionDenied(
                    f"ptrace of {tid} refused{why}; run stacklens as root with CAP_SYS_PTRACE, "
                    "or check whether another debugger (TracerPid in /proc/PID/status) or a "
                    "seccomp/container policy blocks ptrace") from None
            raise
        self.attached = True

    # -- waiting -----------------------------------------------------------------------
    def wait(self, deadline: float) -> int:
        """waitpid() with a deadline; returns the raw status of a stop."""
        delay = 0.0002
        while True:
            try:
                pid, status = os.waitpid(self.tid, os.WNOHANG | WALL)
            except ChildProcessError:
                raise NoSuchProcess(f"thread {self.tid} exited during attach") from None
            if pid == self.tid:
                if os.WIFEXITED(status) or os.WIFSIGNALED(status):
                    self.attached = False
                    raise NoSuchProcess(f"PID {self.tid} exited during attach")
                return status
            if time.monotonic() > deadline:
                raise Timeout(f"thread {self.tid} did not stop in time")
            time.sleep(delay)
            delay = min(delay * 2, 0.005)

    def stop(self, deadline: float) -> None:
        """PTRACE_INTERRUPT and wait for the event stop; signals seen first are kept for later."""
        call(PTRACE_INTERRUPT, self.tid)
        while True:
            status = self.wait(deadline)
            sig = os.WSTOPSIG(status)
            if (status >> 16) == PTRACE_EVENT_STOP:
                return
            # a signal-delivery-stop came first: suppress it now, deliver it at detach
            if sig not in (signal.SIGTRAP,):
                self.pending_signals.append(sig)
            call(PTRACE_CONT, self.tid, 0, 0)

    def wait_for_signal(self, want: int, deadline: float, step: bool = False) -> None:
        """Resume until a signal-delivery-stop of ``want``; other signals are kept for later.

        ``step``: resume with PTRACE_SINGLESTEP (we are stepping one instruction), else CONT.
        """
        while True:
            status = self.wait(deadline)
            sig = os.WSTOPSIG(status)
            event = status >> 16
            if event == 0 and sig == want:
                return
            if event == 0:
                self.pending_signals.append(sig)
            call(PTRACE_SINGLESTEP if step else PTRACE_CONT, self.tid, 0, 0)

    # -- registers ---------------------------------------------------------------------
    def get_regs(self) -> Regs:
        r = Regs()
        call(PTRACE_GETREGS, self.tid, 0, ctypes.addressof(r))
        return r

    def set_regs(self, r: Regs) -> None:
        call(PTRACE_SETREGS, self.tid, 0, ctypes.addressof(r))

    def get_fpstate(self) -> tuple[int, bytes]:
        """The whole extended FP state (XSAVE area), falling back to the legacy FXSAVE area."""
        for nt, size in ((NT_X86_XSTATE, 16384), (NT_PRFPREG, 512)):
            buf = ctypes.create_string_buffer(size)
            iov = IOVec(ctypes.addressof(buf), size)
            try:
                call(PTRACE_GETREGSET, self.tid, nt, ctypes.addressof(iov))
            except PtraceError:
                continue
            return nt, buf.raw[: iov.iov_len]
        raise PtraceError(errno.EIO, "cannot read FP state")

    def set_fpstate(self, state: tuple[int, bytes]) -> None:
        nt, data = state
        buf = ctypes.create_string_buffer(data, len(data))
        iov = IOVec(ctypes.addressof(buf), len(data))
        call(PTRACE_SETREGSET, self.tid, nt, ctypes.addressof(iov))

    # -- running -----------------------------------------------------------------------
    def cont(self, sig: int = 0) -> None:
        call(PTRACE_CONT, self.tid, 0, sig)

    def singlestep(self) -> None:
        call(PTRACE_SINGLESTEP, self.tid, 0, 0)

    def interrupt(self) -> None:
        call(PTRACE_INTERRUPT, self.tid)

    def detach(self) -> None:
        """Detach (the tracee must be stopped); re-deliver intercepted signals."""
        if not self.attached:
            return
        sigs = self.pending_signals
        first = sigs[0] if sigs else 0
        try:
            call(PTRACE_DETACH, self.tid, 0, first)
        except PtraceError as e:
            if e.errno != errno.ESRCH:
                raise
        self.attached = False
        for s in sigs[1:]:
            try:
                os.kill(self.tid, s)
            except OSError:
                pass
