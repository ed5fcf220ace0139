"""`stacklens dump PID`: every thread's Python stack, read from the target's memory, no agent.

Requires root (or CAP_SYS_PTRACE) to read /proc/PID/mem. The target is never stopped (py-spy's
--nonblocking): its memory is read while it runs, through `ProcessMemory`. What makes the result
consistent anyway: each thread's frame chain is read twice and kept only when both reads agree
(a thread that runs Python moves between them: read again, up to `ATTEMPTS` times, else its
stack is marked `consistent: false`); every code object is named by `PySymbolizer`, which checks
what it reads (a torn or freed object gives a marked frame, never a wrong name). A thread blocked
in a collective does not move, so its stack is exact.

Cost: one ELF symbol lookup of the runtime's file (find_python, milliseconds), then per thread
~2 × depth small preads, and a few per distinct code object; no ptrace, no signal, nothing
written: the target runs on at its former speed.
"""

from __future__ import annotations

import struct
import time
from dataclasses import dataclass, field

from stacklens.errors import MemoryReadError, StacklensError
from stacklens.introspect import python_layouts as pl
from stacklens.introspect.memory import ProcessMemory, ProcMem, read_u64
from stacklens.introspect.procfs import SYSCALL_NAMES, ProcFS
from stacklens.pystacks.pysym import SL_PYF_NOCODE, PySymbolizer, RawPyFrame, RawPyStack
from stacklens.pystacks.python_process import PyInterpreter, PyThread, find_interpreter, walk_threads

MAX_DEPTH = 256   # frames kept per thread; deeper stacks are marked truncated
ATTEMPTS = 4      # reads of a moving thread's stack before it is reported as inconsistent


@dataclass(frozen=True)
class PyFrameText:
    file: str
    function: str
    line: int

    def __str__(self) -> str:
        return f"{self.function} ({self.file}:{self.line})"


@dataclass(frozen=True)
class ThreadDump:
    tid: int                      # host thread id (0: a Python thread whose tid is not known)
    name: str                     # /proc/PID/task/TID/comm
    state: str                    # R, S, D, ... ("?" when gone)
    syscall: str                  # what a blocked thread waits in ("running", "futex", ...)
    main: bool
    python: bool                  # has a PyThreadState
    frames: tuple[PyFrameText, ...] = ()   # innermost first
    holds_gil: bool = False
    consistent: bool = True       # two reads of the stack agreed
    truncated: bool = False
    note: str = ""


@dataclass(frozen=True)
class ProcessDump:
    pid: int
    comm: str
    python_version: str
    gil: str                      # "held" | "released" | "unknown"
    gil_holder_tid: int | None    # host tid of the GIL holder (None: released, unknown, or not ours)
    threads: tuple[ThreadDump, ...]
    elapsed_ms: float
    stopped_ms: float = 0.0       # how long the target was stopped: never
    method: str = "nonblocking: /proc/PID/mem read while the target runs, each stack read twice"
    notes: tuple[str, ...] = field(default_factory=tuple)

    def main_thread(self) -> ThreadDump | None:
        return next((t for t in self.threads if t.main), None)

    def to_json(self) -> dict:
        return {
            "pid": self.pid, "comm": self.comm, "python_version": self.python_version,
            "gil": self.gil, "gil_holder_tid": self.gil_holder_tid,
            "elapsed_ms": round(self.elapsed_ms, 3), "stopped_ms": self.stopped_ms,
            "method": self.method, "notes": list(self.notes),
            "threads": [{
                "tid": t.tid, "name": t.name, "state": t.state, "syscall": t.syscall,
                "main": t.main, "python": t.python, "holds_gil": t.holds_gil,
                "consistent": t.consistent, "truncated": t.truncated, "note": t.note,
                "frames": [{"file": f.file, "function": f.function, "line": f.line}
                           for f in t.frames],
            } for t in self.threads],
        }


# ---- reading one thread's frames -------------------------------------------------------------


def _first_frame(mem: ProcessMemory, lay: pl.PyLayout, tstate: int) -> int:
    frame = read_u64(mem, tstate + lay.tstate_frame)
    if frame and lay.cframe_current_frame >= 0:      # 3.11/3.12: tstate->cframe->current_frame
        frame = read_u64(mem, frame + lay.cframe_current_frame)
    return frame


def _code_tag(mem: ProcessMemory, lay: pl.PyLayout, code: int) -> int:
    try:
        a, b = struct.unpack("<QQ", mem.read(code + lay.code_tag_offset(), 16))
    except MemoryReadError:
        return 0
    return a ^ b


def walk_stack(mem: ProcessMemory, lay: pl.PyLayout, tstate: int,
               max_depth: int = MAX_DEPTH) -> RawPyStack:
    """A thread's frames from its PyThreadState, innermost first: what pystack.h reads in BPF,
    read here from user space (same fields, same skipping of shim frames, same tags)."""
    frames: list[RawPyFrame] = []
    truncated, status = False, 0
    try:
        frame = _first_frame(mem, lay, tstate)
    except MemoryReadError:
        return RawPyStack(4, False, ())
    size = lay.frame_read_size()
    seen: set[int] = set()
    while frame:
        if len(frames) >= max_depth or frame in seen:   # a cycle: torn links of a moving thread
            truncated = True
            break
        seen.add(frame)
        try:
            buf = mem.read(frame, size)
        except MemoryReadError:
            status = 4
            break
        prev = struct.unpack_from("<Q", buf, lay.frame_previous)[0]
        if lay.frame_owner >= 0 and lay.owner_shim_min >= 0 and buf[lay.frame_owner] >= lay.owner_shim_min:
            frame = prev
            continue
        code = struct.unpack_from("<Q", buf, lay.frame_code)[0] & (lay.code_ptr_mask & (2**64 - 1))
        if lay.frame_style == pl.FRAME_STYLE_OBJECT:
            lasti = struct.unpack_from("<i", buf, lay.frame_instr)[0]
            offset = -1 if lasti < 0 else lasti * 2
        else:
            instr = struct.unpack_from("<Q", buf, lay.frame_instr)[0]
            offset = (instr - (code + lay.code_adaptive)) & 0xFFFFFFFF
            offset = offset - (1 << 32) if offset >= 1 << 31 else offset
        tag = _code_tag(mem, lay, code) if code else 0
        frames.append(RawPyFrame(code, tag, offset, 0 if code else SL_PYF_NOCODE))
        frame = prev
    return RawPyStack(status, truncated, tuple(frames))


def _chain(raw: RawPyStack) -> tuple:
    """What must agree between two reads: the functions, not where in them a running thread is."""
    return raw.status, raw.truncated, tuple((f.code, f.tag) for f in raw.frames)


def stable_stack(mem: ProcessMemory, lay: pl.PyLayout, tstate: int,
                 attempts: int = ATTEMPTS) -> tuple[RawPyStack, bool]:
    """(stack, consistent): two reads in a row with the same chain of code objects (a running
    thread's current lines may differ: the second read's are kept), else the last read and False."""
    last = walk_stack(mem, lay, tstate)
    for _ in range(attempts):
        again = walk_stack(mem, lay, tstate)
        if _chain(again) == _chain(last):
            return again, True
        last = again
    return last, False


# ---- the GIL ----------------------------------------------------------------------------------


def read_gil(mem: ProcessMemory, interp: PyInterpreter) -> tuple[str, int]:
    """("held", holder tstate) | ("released", 0) | ("unknown", 0), from the runtime's GIL state
    (`locked` and `last_holder`; offsets in introspect/python_layouts.py)."""
    lay = interp.layout
    if lay.gil_locked < 0 or lay.gil_holder < 0:
        return "unknown", 0
    base = interp.main_interp if lay.gil_in_interp else interp.runtime_addr
    try:
        locked = struct.unpack("<i", mem.read(base + lay.gil_locked, 4))[0]
        holder = read_u64(mem, base + lay.gil_holder)
    except MemoryReadError:
        return "unknown", 0
    if locked not in (0, 1):
        return "unknown", 0
    return ("held", holder) if locked else ("released", 0)


# ---- the whole process -----------------------------------------------------------------------


def _frames(sym: PySymbolizer, raw: RawPyStack) -> tuple[PyFrameText, ...]:
    out = []
    for f in raw.frames:                       # innermost first, as the dump prints them
        fr = sym.frame(f)
        out.append(PyFrameText(fr.file or "?", fr.name, fr.line))
    return tuple(out)


def _thread_info(procfs: ProcFS, pid: int, tid: int) -> tuple[str, str, str]:
    try:
        name = procfs.thread_comm(pid, tid)
        state = procfs.thread_state(pid, tid)
    except (StacklensError, OSError):          # the thread ended while we looked
        return "?", "?", "gone"
    sc = procfs.thread_syscall(pid, tid)
    return name, state, SYSCALL_NAMES.get(int(sc), sc) if sc.isdigit() else sc


def dump_process(pid: int, procfs: ProcFS | None = None,
                 mem: ProcessMemory | None = None) -> ProcessDump:
    """Every thread of `pid`: its name, state, and (Python threads) its stack and the GIL.
    Raises NoSuchProcess, PermissionDenied, UnsupportedVersion (not a CPython we can read)."""
    t0 = time.perf_counter()
    procfs = procfs or ProcFS()
    own = mem is None
    mem = mem or ProcMem(pid, procfs)
    try:
        interp = find_interpreter(pid, mem, procfs)
        lay = interp.layout
        threads: list[PyThread] = walk_threads(mem, interp)
        gil, holder = read_gil(mem, interp)
        sym = PySymbolizer(mem, lay, interp.code_type_addr)
        host = procfs.host_tids(pid)
        tids = procfs.tasks(pid)
        by_tid: dict[int, ThreadDump] = {}
        unknown: list[ThreadDump] = []
        for t in threads:
            raw, ok = stable_stack(mem, lay, t.tstate)
            tid = host.get(t.native_tid, t.native_tid) if t.native_tid else 0
            if not tid and lay.tstate_native_thread_id < 0 and t is threads[-1]:
                tid = pid     # 3.10 keeps no tid; the oldest thread state is the main thread's
            name, state, sc = _thread_info(procfs, pid, tid) if tid else ("?", "?", "?")
            td = ThreadDump(tid, name, state, sc, tid == pid, True, _frames(sym, raw),
                            holds_gil=gil == "held" and holder == t.tstate, consistent=ok,
                            truncated=raw.truncated,
                            note="" if raw.status == 0 else "stack unreadable past the last frame")
            if tid:
                by_tid[tid] = td
            else:
                unknown.append(td)
        for tid in tids:
            if tid not in by_tid:
                name, state, sc = _thread_info(procfs, pid, tid)
                by_tid[tid] = ThreadDump(tid, name, state, sc, tid == pid, False)
        out = sorted(by_tid.values(), key=lambda d: (not d.main, d.tid)) + unknown
        holder_tid = next((d.tid for d in out if d.holds_gil), None)
        notes = []
        if gil == "held" and holder_tid is None:
            notes.append("the GIL is held by a thread state not in the main interpreter's list")
        return ProcessDump(pid, procfs.comm(pid), "%d.%d" % interp.version, gil, holder_tid,
                           tuple(out), (time.perf_counter() - t0) * 1e3, notes=tuple(notes))
    finally:
        if own:
            mem.close()  # type: ignore[attr-defined]


__all__ = ["PyFrameText", "ThreadDump", "ProcessDump", "walk_stack", "stable_stack", "read_gil",
           "dump_process"]
