"""``inject_agent(pid, socket_path, timeout_s)``: load the agent into a running CPython process.

Requires root / CAP_SYS_PTRACE. The method is chosen by the target's CPython version, read from
the target (``introspect.cpython.find_python``): 3.14+ the PEP 768 protocol (no stop at all), 3.10–3.13 the
ptrace pending-call injector (main thread stopped ~1 ms). Either way the bootstrap runs on the
target's main thread at its next eval-breaker check; we then wait for the agent's hello on the
``AgentServer`` at ``socket_path``. If it does not come within ``timeout_s`` the request is
withdrawn (PEP 768: pending flag cleared; ptrace: the queued text emptied) and ``Timeout`` says the
target is not executing Python, naming the syscall its main thread is blocked in.
Refused before anything is written: a target that opted out of remote debugging
(``PYTHON_DISABLE_REMOTE_DEBUG``, ``-X disable_remote_debug``; every version, every method) and a
stopped one (state T: it would run nothing until continued).
"""

from __future__ import annotations

import os
import secrets
import threading
import time
from dataclasses import dataclass

from stacklens.errors import (AlreadyAttached, AttachError, InputError, NoSuchProcess, PermissionDenied, Timeout,
                      UnsupportedVersion)
from stacklens.inject import pep768, ptrace_inject
from stacklens.inject.bootstrap import THREAD_NAME, pending_call_text, script_file_text
from stacklens.introspect.cpython import PythonTarget, find_python
from stacklens.introspect.memory import RemoteMemory
from stacklens.introspect.procfs import SYSCALL_NAMES, ProcFS
from stacklens.introspect.python_layouts import REMOTE_DEBUG_SUPPORTED, SUPPORTED
from stacklens.inject.channel.server import AgentServer, server_for

MIN_VERSION = SUPPORTED[0]
PEP768_VERSION = REMOTE_DEBUG_SUPPORTED[0]   # the first whose remote-debugger fields are known

_IN_PROGRESS: set[int] = set()
_IN_PROGRESS_LOCK = threading.Lock()


@dataclass(frozen=True)
class AttachResult:
    pid: int
    method: str                    # "pep768" | "ptrace"
    python: tuple[int, int, int]
    version_source: str
    latency_s: float               # from the call to the agent's hello
    stop_us: int                   # how long the main thread was stopped (0 for PEP 768)


def choose_method(tp: PythonTarget) -> str:
    if tp.minor < MIN_VERSION:
        raise UnsupportedVersion(
            f"PID {tp.pid} runs CPython {'.'.join(map(str, tp.version))}; stacklens injects into "
            f"{MIN_VERSION[0]}.{MIN_VERSION[1]} and newer. The eBPF probes still work without the "
            "agent.")
    return "pep768" if tp.minor >= PEP768_VERSION else "ptrace"


def _syscall_desc(nr: str) -> str:
    """A syscall number (decimal text from /proc/.../syscall) in words: "the futex syscall"."""
    return f"the {SYSCALL_NAMES.get(int(nr), 'syscall ' + nr)} syscall"


def _blocked_reason(procfs: ProcFS, pid: int) -> str:
    try:
        if procfs.thread_state(pid, pid) == "T":
            return f"its main thread is stopped (SIGSTOP or job control: state T); resume it with `kill -CONT {pid}`"
    except (NoSuchProcess, PermissionDenied, OSError, IndexError):
        pass
    nr = procfs.thread_syscall(pid, pid)
    if nr.isdigit():
        return f"its main thread is blocked in {_syscall_desc(nr)}"
    if nr == "running":
        return "its main thread is running native code (no eval-breaker check)"
    return "its main thread did not reach an eval-breaker check"


def _agent_threads(procfs: ProcFS, pid: int) -> dict[int, str]:
    """Threads of ``pid`` named by a bootstrap (``comm`` = "stacklens-agent"): tid -> state/syscall."""
    out: dict[int, str] = {}
    try:
        tids = procfs.tasks(pid)
    except (NoSuchProcess, OSError):
        return out
    for tid in tids:
        try:
            if procfs.thread_comm(pid, tid) != THREAD_NAME:
                continue
            state = procfs.thread_state(pid, tid)
            nr = procfs.thread_syscall(pid, tid)
        except (NoSuchProcess, PermissionDenied, OSError, ValueError):
            continue                        # the thread (an exiting agent's) is gone meanwhile
        out[tid] = f"state {state}, " + (f"in {_syscall_desc(nr)}" if nr.isdigit() else nr)
    return out


def _timeout_error(procfs: ProcFS, pid: int, timeout_s: float, agents_before: dict[int, str]) -> Timeout:
    new = {t: s for t, s in _agent_threads(procfs, pid).items() if t not in agents_before}
    if new:
        # The bootstrap ran (its thread named itself) but no hello came: not "not executing Python".
        who = "; ".join(f"thread {t}: {s}" for t, s in sorted(new.items()))
        return Timeout(f"agent did not connect back: PID {pid} ran the bootstrap but its agent thread "
                       f"sent no hello within {timeout_s:g} s ({who}; main thread: "
                       f"{_blocked_reason(procfs, pid).removeprefix('its main thread ')}). It may still "
                       "connect while the AgentServer listens; closing the server makes it exit.")
    return Timeout(f"target not executing Python: PID {pid} did not run the bootstrap within "
                   f"{timeout_s:g} s ({_blocked_reason(procfs, pid)}); the request was "
                   "withdrawn and the target is unchanged. Retry when it runs Python code.")


def remote_debug_opt_out(procfs: ProcFS, pid: int) -> str | None:
    """How the target opted out of remote debugging (PEP 768), in words, or None: a non-empty
    PYTHON_DISABLE_REMOTE_DEBUG in its initial environment (/proc/PID/environ) or
    ``-X disable_remote_debug`` among the interpreter's options (/proc/PID/cmdline)."""
    env = procfs.environ(pid) or b""
    for entry in env.split(b"\0"):
        name, eq, value = entry.partition(b"=")
        if name == b"PYTHON_DISABLE_REMOTE_DEBUG" and eq and value:
            return "PYTHON_DISABLE_REMOTE_DEBUG is set in its environment"
    args = procfs.cmdline(pid)[1:]
    i = 0
    while i < len(args):                # interpreter options end at the script, -c, -m or --
        a = args[i]
        if not a.startswith("-") or a in ("-", "--"):
            break
        opts = a[1:]
        for j, ch in enumerate(opts):
            if ch in "cm":
                return None
            if ch in "XW":              # the value is the rest of this word or the next one
                value = opts[j + 1:]
                if not value:
                    i += 1
                    value = args[i] if i < len(args) else ""
                if ch == "X" and value.split("=", 1)[0] == "disable_remote_debug":
                    return "it runs with -X disable_remote_debug"
                break
        i += 1
    return None


def _check_runnable(procfs: ProcFS, pid: int) -> None:
    """A stopped target (SIGSTOP, Ctrl-Z: state T) runs no bootstrap until continued: say so now
    instead of timing out on a reason that looks like a syscall."""
    try:
        state = procfs.thread_state(pid, pid)
    except (NoSuchProcess, OSError, IndexError):
        return
    if state == "T":
        raise AttachError(f"PID {pid} is stopped (SIGSTOP or job control: state T in /proc/{pid}/stat): "
                          f"resume it with `kill -CONT {pid}`, then attach again")


def _exited(procfs: ProcFS, pid: int) -> bool:
    try:
        return procfs.thread_state(pid, pid) in ("Z", "X")
    except NoSuchProcess:
        return True


def inject_agent(pid: int, socket_path: str | None = None, timeout_s: float = 5.0, *,
                 server: AgentServer | None = None, method: str = "auto",
                 procfs: ProcFS | None = None) -> AttachResult:
    if type(pid) is not int or pid <= 0:
        raise InputError(f"bad PID {pid!r}: give the numeric PID of a running Python process")
    if pid == os.getpid():
        raise InputError("stacklens cannot attach to itself")
    if timeout_s <= 0:
        raise InputError("timeout_s must be positive")
    procfs = procfs or ProcFS()
    if not procfs.exists(pid):
        raise NoSuchProcess(f"no process with PID {pid}: check the PID (`ps -p {pid}`)")
    server = server or (server_for(socket_path) if socket_path else None)
    if server is None:
        raise InputError("inject_agent needs the AgentServer (or its socket_path) that the agent "
                         "connects back to: srv = AgentServer(pid, dir); inject_agent(pid, srv.path)")
    if server.pid != pid:
        raise InputError(f"the AgentServer at {server.path} serves PID {server.pid}, not {pid}")
    if server.connected:
        raise AlreadyAttached(f"an agent is already attached to PID {pid}; detach it first")
    with _IN_PROGRESS_LOCK:
        if pid in _IN_PROGRESS:
            raise AlreadyAttached(f"an attach to PID {pid} is already in progress")
        _IN_PROGRESS.add(pid)
    try:
        return _inject(pid, server, timeout_s, method, procfs)
    finally:
        with _IN_PROGRESS_LOCK:
            _IN_PROGRESS.discard(pid)


def _inject(pid: int, server: AgentServer, timeout_s: float, method: str, procfs: ProcFS) -> AttachResult:
    t0 = time.monotonic()
    deadline = t0 + timeout_s
    mem = RemoteMemory(pid)
    _check_runnable(procfs, pid)
    tp = find_python(pid, procfs, mem)
    chosen = choose_method(tp) if method == "auto" else method
    if chosen not in ("pep768", "ptrace"):
        raise InputError(f"unknown injection method {method!r}")
    why = remote_debug_opt_out(procfs, pid)
    if why:
        # PEP 768's opt-out, honoured for every version and method (3.14's runtime flag is
        # checked again by pep768.request_exec: it also sees a flag set by other means)
        raise AttachError(f"PID {pid} disabled remote debugging ({why}): stacklens does not inject its agent "
                          "into it. Profile it without the agent (eBPF only), or restart it without the opt-out.")
    server.reset_hello()
    agents_before = _agent_threads(procfs, pid)
    nonce = secrets.token_hex(4)
    if chosen == "pep768":
        if "_PyRuntime" not in tp.symbols:
            raise AttachError(f"{tp.binary} does not export _PyRuntime; cannot use PEP 768")
        script = server.write_agent_file(f"bootstrap-{server.token[:8]}.py",
                                         script_file_text(server.target_path, server.target_agent_dir,
                                                          server.token, nonce))
        req = pep768.request_exec(mem, tp.symbols["_PyRuntime"], pid, script)
        stop_us = 0

        def withdraw() -> None:
            pep768.withdraw(mem, req)
    else:
        text = pending_call_text(server.target_path, server.target_agent_dir, server.token, nonce)
        call = ptrace_inject.queue_pending_call(tp, text, timeout_s=max(0.1, deadline - time.monotonic()),
                                                procfs=procfs, mem=mem)
        stop_us = call.stop_us

        def withdraw() -> None:
            ptrace_inject.disarm(pid, call.page, mem)
    try:
        while not server.wait_hello(0.02):
            if time.monotonic() > deadline:
                withdraw()
                if server.wait_hello(0.05):   # it connected while we withdrew
                    break
                raise _timeout_error(procfs, pid, timeout_s, agents_before)
            if not procfs.exists(pid) or _exited(procfs, pid):
                raise NoSuchProcess(f"PID {pid} exited during attach")
    except BaseException:
        raise
    else:
        if chosen == "ptrace":
            ptrace_inject.disarm(pid, call.page, mem)   # a stale queued call now does nothing
    return AttachResult(pid, chosen, tp.version, tp.version_source, time.monotonic() - t0, stop_us)
