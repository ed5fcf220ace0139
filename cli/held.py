"""Start a command held stopped until the probes are attached (`stacklens record`), as
`perf record -- CMD` does, so nothing the program runs is lost.

Requires ptrace of our own child only (PTRACE_TRACEME: any yama scope below 3). The breakpoints
are x86-64 (int3); elsewhere the program is held at its exec only. Cost: two or three stops of
the child before its first Python line, milliseconds.

How: a fresh interpreter (_LAUNCHER) calls ptrace(PTRACE_TRACEME) and execs the command, so
the kernel stops it right after the exec, in the clean image of the new program (stopping it
before the exec, e.g. with SIGSTOP, would show the probes our own forked image). The dynamic loader has not mapped libpython yet
there, so a first breakpoint at the program's entry point lets it do that; a Python program is
then let run to its first `_PyEval_EvalFrameDefault` call (the first Python code, inside
Py_Initialize), where the interpreter and its main thread state exist and the script has not
begun. That stop is repeated until the thread state is readable the way the probes read it (the
TSS slot is set), a few calls at most. Then, for a script or `-c`, on to where the interpreter
starts it (`_PyRun_AnyFileObject`, `PyRun_SimpleStringFlags`): its start-up (site and its .pth
imports, whose freed module code objects the profile could only show as `[stale code object]`)
runs before the probes attach, and the profile starts at the program's first line. `-m` runs its
module through runpy, with no such entry: held at the first Python code, the start-up included.
Anything that is not Python is held at its entry point.
`release()` detaches: the program runs on as if never stopped. If stacklens dies while holding
it, the kernel kills it (PTRACE_O_EXITKILL), so no program stays stopped for ever.
"""

from __future__ import annotations

import os
import platform
import signal
import shutil
import subprocess
import sys

from stacklens.errors import AttachError, InputError, MemoryReadError, NoSuchProcess, NotApplicable
from stacklens.introspect import ptrace
from stacklens.introspect.procfs import ProcFS
from stacklens.introspect.python_layouts import RUN_STRING_NAMED_SINCE
from stacklens.introspect.ptrace import (
    PTRACE_CONT, PTRACE_DETACH, PTRACE_EVENT_EXEC, PTRACE_O_EXITKILL, PTRACE_O_TRACEEXEC, PTRACE_PEEKTEXT,
    PTRACE_PEEKUSER, PTRACE_POKETEXT, PTRACE_POKEUSER, PTRACE_SETOPTIONS, PTRACE_SINGLESTEP, Regs)

RIP_OFFSET = Regs.rip.offset  # struct user_regs_struct.rip (x86-64)
AT_ENTRY = 9
EVAL = "_PyEval_EvalFrameDefault"
# where the interpreter starts the program: a script (or stdin), and -c (through the unexported
# RUN_STRING_NAMED from CPython RUN_STRING_NAMED_SINCE on; before, RUN_STRING)
RUN_FILE, RUN_STRING, RUN_STRING_NAMED = "_PyRun_AnyFileObject", "PyRun_SimpleStringFlags", \
    "_PyRun_SimpleStringFlagsWithName"
MAX_EVAL_STOPS = 64           # eval calls waited for a readable thread state before giving up
WRAPPERS = ("env",)           # exec'd programs that exec the real one (`#!/usr/bin/env python3`)

def _ptrace(req: int, pid: int, addr: int = 0, data: int = 0) -> int:
    """One request through the one ptrace binding; the result as an unsigned word (PEEKTEXT's
    word is poked back with an int3 in its low byte)."""
    return ptrace.call(req, pid, addr, data) & 0xFFFF_FFFF_FFFF_FFFF


# The traced start goes through a fresh interpreter that asks to be traced and execs the command:
# Python code between fork and exec (subprocess's preexec_fn) runs the parent's fork handlers in
# the child, and in a process that has used gRPC those abort it (SIGABRT, seen in the test suite).
_LAUNCHER = ("import ctypes, os, sys; ctypes.CDLL(None).ptrace(0, 0, 0, 0); "
             "os.execv(sys.argv[1], sys.argv[2:])")


def _resolve(cmd0: str) -> str:
    path = shutil.which(cmd0) if os.sep not in cmd0 else cmd0
    if path is None or not os.path.exists(path):
        raise InputError(f"cannot run {cmd0!r}: No such file or directory; check the command and PATH")
    if not os.access(path, os.X_OK):
        raise InputError(f"cannot run {cmd0!r}: Permission denied; check the command and PATH")
    return path


# options of the python command line that take a value (the next argument when not attached)
_VALUE_OPTIONS = frozenset("WX")


def _main_entry(argv: list[str]) -> str | None:
    """The interpreter function that starts the program `python ARGS` runs: RUN_STRING for -c,
    RUN_FILE for a script; None for -m (runpy: no entry of its own) and stdin (3.13's REPL is
    started through runpy too)."""
    args = iter(argv[1:])
    for a in args:
        if a == "--":
            return RUN_FILE if next(args, "-") != "-" else None
        if a == "-":
            return None
        if not a.startswith("-"):
            return RUN_FILE
        if a.startswith("--"):
            if a == "--check-hash-based-pycs":
                next(args, None)
            continue
        for i, flag in enumerate(a[1:], 1):
            if flag == "c":
                return RUN_STRING
            if flag == "m":
                return None
            if flag in _VALUE_OPTIONS:
                if i == len(a) - 1:
                    next(args, None)
                break
    return None


def _start_address(py, entry: str | None) -> int:
    """Where `entry` starts in this interpreter; 0 where it is unknown (the program would run
    past an entry it never calls: better held at its first Python code)."""
    if entry == RUN_STRING:
        if RUN_STRING_NAMED in py.symbols:
            return py.symbols[RUN_STRING_NAMED]
        return py.symbols.get(RUN_STRING, 0) if py.minor < RUN_STRING_NAMED_SINCE else 0
    return py.symbols.get(entry, 0) if entry else 0


class HeldCommand:
    """`cmd` started and stopped before its first instruction (or, for Python, its first Python
    code). `where` says where it is held; `release()` lets it run; `wait()` reaps it."""

    def __init__(self, cmd: list[str], **popen_kw) -> None:
        self.where = "exec"
        self.notes: list[str] = []
        self._traced = True
        try:
            self.proc = subprocess.Popen([sys.executable, "-S", "-E", "-c", _LAUNCHER, _resolve(cmd[0]), *cmd],
                                         **popen_kw)
        except (FileNotFoundError, PermissionError) as e:
            raise InputError(f"cannot run {cmd[0]!r}: {e.strerror}; check the command and PATH") from e
        self.pid = self.proc.pid
        try:
            self._wait_stop()                        # the exec's SIGTRAP
            _ptrace(PTRACE_SETOPTIONS, self.pid, 0, PTRACE_O_TRACEEXEC | PTRACE_O_EXITKILL)
            while os.path.basename(self._exe()) in WRAPPERS:
                self._cont_until_exec()
            if platform.machine() in ("x86_64", "AMD64"):
                self._run_to(self._entry())
                self.where = "entry"
                py = self._python()
                if py is not None and py.symbols.get(EVAL):
                    self._run_to_ready(py.symbols[EVAL])
                    start = _start_address(py, _main_entry(ProcFS().cmdline(self.pid)))
                    if start and self.where == "first Python code":
                        self._run_to(start)
                        self.where = "program's first line"
        except BaseException:
            self.kill()
            raise

    # ---- holding -------------------------------------------------------------------------
    def _wait_stop(self) -> int:
        """Wait for the next stop; signals the program gets meanwhile are passed on."""
        while True:
            _, status = os.waitpid(self.pid, 0)
            if os.WIFEXITED(status) or os.WIFSIGNALED(status):
                self._traced = False
                self.proc.returncode = (os.WEXITSTATUS(status) if os.WIFEXITED(status)
                                        else -os.WTERMSIG(status))
                raise NoSuchProcess(f"the command exited (status {self.proc.returncode}) before it "
                                    "could be profiled")
            if os.WIFSTOPPED(status):
                return status

    def _cont_until_exec(self) -> None:
        _ptrace(PTRACE_CONT, self.pid)
        while True:
            status = self._wait_stop()
            if status >> 8 == signal.SIGTRAP | (PTRACE_EVENT_EXEC << 8):
                return
            _ptrace(PTRACE_CONT, self.pid, 0, self._signal_of(status))

    @staticmethod
    def _signal_of(status: int) -> int:
        sig = os.WSTOPSIG(status)
        return 0 if sig == signal.SIGTRAP else sig

    def _run_to(self, addr: int) -> None:
        """Continue until the program executes `addr` (a one-shot int3 there)."""
        word = _ptrace(PTRACE_PEEKTEXT, self.pid, addr)
        _ptrace(PTRACE_POKETEXT, self.pid, addr, (word & ~0xFF) | 0xCC)
        try:
            _ptrace(PTRACE_CONT, self.pid)
            while True:
                status = self._wait_stop()
                if os.WSTOPSIG(status) == signal.SIGTRAP and \
                        _ptrace(PTRACE_PEEKUSER, self.pid, RIP_OFFSET) == addr + 1:
                    break
                if status >> 8 == signal.SIGTRAP | (PTRACE_EVENT_EXEC << 8):
                    raise AttachError("the command exec'd another program before its entry point")
                _ptrace(PTRACE_CONT, self.pid, 0, self._signal_of(status))
        finally:
            if self._traced:
                _ptrace(PTRACE_POKETEXT, self.pid, addr, word)
        _ptrace(PTRACE_POKEUSER, self.pid, RIP_OFFSET, addr)

    def _run_to_ready(self, addr: int) -> None:
        from stacklens.pystacks.python_process import thread_state_readable

        for n in range(MAX_EVAL_STOPS):
            if n:   # step off the restored instruction, then stop at the next call
                self._step_off()
            self._run_to(addr)
            ok, why = thread_state_readable(self.pid)
            if ok:
                self.where = "first Python code"
                return
        self.where = "Python code"
        self.notes.append(f"record: the thread state was not readable after {MAX_EVAL_STOPS} Python "
                          f"calls ({why}); Python stacks may start late")

    def _step_off(self) -> None:
        """Execute the instruction under a removed breakpoint, so the next one there stops again."""
        _ptrace(PTRACE_SINGLESTEP, self.pid)
        self._wait_stop()

    def _exe(self) -> str:
        return ProcFS().exe(self.pid)

    def _entry(self) -> int:
        for key, val in ProcFS().auxv(self.pid):
            if key == AT_ENTRY:
                return val
        raise AttachError(f"no entry point in the auxiliary vector of PID {self.pid}")

    def _python(self):
        """The interpreter with the addresses of its eval loop and program entries (None: not a
        Python process, or its library is not mapped yet)."""
        from stacklens.introspect.cpython import find_python

        try:
            return find_python(self.pid, symbols=(EVAL, RUN_FILE, RUN_STRING, RUN_STRING_NAMED))
        except (NotApplicable, MemoryReadError):
            return None

    # ---- letting go ----------------------------------------------------------------------
    def release(self) -> None:
        if self._traced:
            self._traced = False
            _ptrace(PTRACE_DETACH, self.pid)

    def wait(self) -> tuple[int, int]:
        """Reap the program: (exit status as Popen gives it, CPU time it used in ns)."""
        self.release()
        if self.proc.returncode is not None:
            return self.proc.returncode, 0
        _, status, ru = os.wait4(self.pid, 0)
        self.proc.returncode = os.waitstatus_to_exitcode(status)
        return self.proc.returncode, int((ru.ru_utime + ru.ru_stime) * 1e9)

    def kill(self) -> None:
        if self.proc.returncode is None:
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self._traced = False
            try:
                os.waitpid(self.pid, 0)
            except ChildProcessError:
                pass
            self.proc.returncode = -signal.SIGKILL
