"""Find the CPython interpreter inside a running process and everything pystack.h needs.

Requires root (or CAP_SYS_PTRACE + CAP_SYS_ADMIN) to read /proc/PID/mem and /proc/PID/root;
/sys/kernel/btf/vmlinux for the task_struct layout. Costs: one ELF symbol lookup and a few
/proc/PID/mem reads at attach (milliseconds); `walk_threads` is O(threads) reads.

What it finds:
- the object that holds `_PyRuntime` (libpython3.X.so or a statically linked `python3.X`), its
  load bias, the version (`Py_Version` on 3.11+, `_Py_DebugOffsets` on 3.13+, the file name
  otherwise) and the `PyLayout` (introspect/python_layouts.py picks it; nothing here names a version);
- the thread list of the main interpreter (tstate, pthread_t, native tid);
- how BPF finds the *current* thread's PyThreadState: the gilstate TSS slot in glibc's
  `struct pthread` (`fsbase + specific_1stblock[key].data`). The offset is calibrated on the
  target itself: for each known thread, the slot that holds its own tstate pointer (after an
  odd glibc key sequence number) — so neither the glibc version nor the key is hard-coded;
- the offset of `thread.fsbase` in the running kernel's `task_struct`, from its BTF (the headers
  BCC compiles against may be for another kernel, so they cannot be trusted for this).
"""

from __future__ import annotations

import functools
import struct
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from stacklens.errors import AttachError, MemoryReadError, NotApplicable, UnsupportedVersion
from stacklens.introspect import python_layouts as pl
from stacklens.introspect.cpython import find_python
from stacklens.introspect.memory import ProcessMemory, ProcMem, read_u64
from stacklens.introspect.procfs import ProcFS


def bpf_defines(layout: pl.PyLayout) -> dict[str, int]:
    """The layout half of pystack.h's -D parameters."""
    return {
        "SL_PY_FRAME_STYLE": layout.frame_style,
        "SL_PY_TS_INTERP": layout.tstate_interp,
        "SL_PY_TS_FRAME": layout.tstate_frame,
        "SL_PY_CFRAME_CUR": layout.cframe_current_frame,
        "SL_PY_F_PREV": layout.frame_previous,
        "SL_PY_F_CODE": layout.frame_code,
        "SL_PY_F_INSTR": layout.frame_instr,
        "SL_PY_F_OWNER": layout.frame_owner,
        "SL_PY_F_IS_ENTRY": layout.frame_is_entry,
        "SL_PY_F_READ": layout.frame_read_size(),
        "SL_PY_OWNER_SHIM_MIN": layout.owner_shim_min,
        "SL_PY_CODE_ADAPTIVE": max(layout.code_adaptive, 0),
        "SL_PY_CODE_TAG_OFF": layout.code_tag_offset(),
        "SL_PY_CODE_MASK": layout.code_ptr_mask & 0xFFFFFFFFFFFFFFFF,
    }


# ---------------------------------------------------------------------------------------------
# The interpreter


@dataclass(frozen=True)
class PyInterpreter:
    pid: int
    path: str  # as the target sees it (maps)
    host_path: str  # where it was opened from (map_files, /proc/PID/root)
    version: tuple[int, int]
    hexversion: int  # 0 when only the file name told the version
    runtime_addr: int
    code_type_addr: int  # &PyCode_Type, to validate code objects (0 if not exported)
    layout: pl.PyLayout
    main_interp: int  # PyInterpreterState* of the main interpreter


def find_interpreter(pid: int, mem: Optional[ProcessMemory] = None,
                     procfs: Optional[ProcFS] = None) -> PyInterpreter:
    """Locate `_PyRuntime` (introspect.cpython.find_python), choose the layout; raise
    UnsupportedVersion when in-BPF Python stacks cannot be had."""
    procfs = procfs or ProcFS()
    mem = mem or ProcMem(pid, procfs)
    try:
        tp = find_python(pid, procfs, mem)
    except NotApplicable as e:
        raise UnsupportedVersion(
            f"no CPython interpreter (_PyRuntime) found in process {pid} ({e}): not a Python "
            "process, or a stripped static build; Python frames will be missing") from None
    if "_PyRuntime" not in tp.symbols:
        raise UnsupportedVersion(
            f"{tp.binary} in process {pid} does not export _PyRuntime (a stripped static build?); "
            "Python frames will be missing")
    version = tp.minor
    if tp.name_version is not None and tp.name_version != version:
        raise UnsupportedVersion(
            f"{tp.path} is named {tp.name_version} but {tp.version_source} says {version}; "
            "refusing to guess")
    runtime = tp.symbols["_PyRuntime"]
    head = None
    if pl.needs_debug_offsets(version):
        head = mem.read(runtime, pl.debug_offsets_size(version))
    layout = pl.layout_for(version, head, free_threaded=tp.free_threaded)
    # main interpreter = last in the list (head is the newest)
    interp = read_u64(mem, runtime + layout.runtime_interpreters_head)
    main, hops = interp, 0
    while interp and hops < 1024:
        main = interp
        interp = read_u64(mem, interp + layout.interp_next)
        hops += 1
    if not main:
        raise AttachError(f"CPython in pid {pid} has no interpreter yet (starting or exiting)")
    return PyInterpreter(pid=pid, path=tp.path, host_path=tp.host_path, version=version,
                         hexversion=tp.hexversion, runtime_addr=runtime,
                         code_type_addr=tp.symbols.get("PyCode_Type", 0), layout=layout,
                         main_interp=main)


def thread_state_readable(pid: int, procfs: Optional[ProcFS] = None) -> tuple[bool, str]:
    """Whether a process that is still starting up has what `PythonStackReader` needs: an
    interpreter, a thread state, and the TSS slot BPF reads it from. (ok, why not)."""
    procfs = procfs or ProcFS()
    mem = ProcMem(pid, procfs)
    try:
        interp = find_interpreter(pid, mem, procfs)
        threads = walk_threads(mem, interp)
        if not threads:
            return False, "no thread state yet"
        if calibrate_tls(mem, threads) is None:
            return False, "the thread state is not in its TSS slot yet"
        return True, ""
    except (AttachError, MemoryReadError, UnsupportedVersion) as e:
        return False, str(e)
    finally:
        mem.close()


@dataclass(frozen=True)
class PyThread:
    tstate: int
    pthread: int  # pthread_t (glibc: TCB address == the thread's fsbase)
    native_tid: int  # 0 when the build does not record it (3.10)


def walk_threads(mem: ProcessMemory, interp: PyInterpreter, limit: int = 4096) -> list[PyThread]:
    lay = interp.layout
    out = []
    ts = read_u64(mem, interp.main_interp + lay.interp_threads_head)
    while ts and len(out) < limit:
        pthread = read_u64(mem, ts + lay.tstate_thread_id)
        tid = 0
        if lay.tstate_native_thread_id >= 0:
            tid = struct.unpack("<I", mem.read(ts + lay.tstate_native_thread_id, 4))[0]
        out.append(PyThread(ts, pthread, tid))
        ts = read_u64(mem, ts + lay.tstate_next)
    return out


TCB_SCAN = 0x1000  # glibc's struct pthread: specific_1stblock sits at 0x310 on x86-64


def calibrate_tls(mem: ProcessMemory, threads: list[PyThread]) -> Optional[int]:
    """Offset from a thread's fsbase to the TSS slot holding its PyThreadState, or None.

    glibc keeps `struct pthread_key_data {uintptr_t seq; void *data;}` for keys < 32 inline in
    `struct pthread`; a live key's `seq` is odd. The slot that holds each thread's own tstate
    pointer after an odd `seq` is CPython's gilstate key.
    """
    votes: Counter[int] = Counter()
    checked = 0
    for t in threads:
        if not t.pthread:
            continue
        try:
            blob = mem.read(t.pthread, TCB_SCAN)
        except MemoryReadError:
            continue
        if struct.unpack_from("<Q", blob, 0)[0] != t.pthread:  # tcbhead_t.tcb == self
            continue
        checked += 1
        needle = struct.pack("<Q", t.tstate)
        start = 16
        while True:
            i = blob.find(needle, start)
            if i < 0:
                break
            if i % 8 == 0 and struct.unpack_from("<Q", blob, i - 8)[0] & 1:
                votes[i] += 1
            start = i + 1
    if not votes:
        return None
    off, n = votes.most_common(1)[0]
    # threads caught between creation and binding may lack it; most must agree
    if n * 2 < checked:
        return None
    return off


# ---------------------------------------------------------------------------------------------
# Kernel BTF: offset of task_struct.thread.fsbase

_BTF_KIND_SIZES = {1: 4, 2: 0, 3: 12, 4: None, 5: None, 6: None, 7: 0, 8: 0, 9: 0, 10: 0,
                   11: 0, 12: 0, 13: None, 14: 4, 15: None, 16: 0, 17: 4, 18: 0, 19: None}


def _parse_btf(data: bytes):
    magic, _ver, _flags, hdr_len, type_off, type_len, str_off, _str_len = struct.unpack_from(
        "<HBBIIIII", data, 0)
    if magic != 0xEB9F:
        raise AttachError("not a BTF blob")
    types = [None]
    pos, end = hdr_len + type_off, hdr_len + type_off + type_len
    strs = hdr_len + str_off

    def name(off: int) -> str:
        e = data.index(b"\0", strs + off)
        return data[strs + off:e].decode()

    while pos < end:
        name_off, info, size_type = struct.unpack_from("<III", data, pos)
        kind, vlen, kflag = (info >> 24) & 0x1F, info & 0xFFFF, info >> 31
        pos += 12
        members = None
        if kind in (4, 5):
            members = []
            for j in range(vlen):
                m_name, m_type, m_off = struct.unpack_from("<III", data, pos + 12 * j)
                members.append((m_name, m_type, (m_off & 0xFFFFFF) if kflag else m_off))
            pos += 12 * vlen
        elif kind == 6:
            pos += 8 * vlen
        elif kind == 13:
            pos += 8 * vlen
        elif kind == 15:
            pos += 12 * vlen
        elif kind == 19:
            pos += 12 * vlen
        else:
            extra = _BTF_KIND_SIZES.get(kind)
            if extra is None:
                raise AttachError(f"unknown BTF kind {kind}")
            pos += extra
        types.append((kind, name_off, size_type, members))
    return types, name


@functools.lru_cache(maxsize=4)
def kernel_fsbase_offset(btf_path: str = "/sys/kernel/btf/vmlinux") -> int:
    """offsetof(struct task_struct, thread.fsbase) in the running kernel (x86-64); parsed once per
    process (the kernel does not change under it; ~0.6 s of BTF per attach before)."""
    try:
        data = Path(btf_path).read_bytes()
    except OSError as e:
        raise AttachError(f"cannot read {btf_path}: the kernel needs CONFIG_DEBUG_INFO_BTF "
                          "for in-BPF Python stacks") from e
    types, name = _parse_btf(data)

    def find_struct(want: str) -> int:
        for i, t in enumerate(types):
            if t and t[0] == 4 and name(t[1]) == want:
                return i
        raise AttachError(f"struct {want} not in kernel BTF")

    def member_offset(tid: int, want: str) -> Optional[tuple[int, int]]:
        for m_name, m_type, bits in types[tid][3]:
            if m_name and name(m_name) == want:
                return bits // 8, m_type
            if not m_name:  # anonymous struct/union: search inside
                inner = m_type
                while types[inner][0] in (8, 9, 10, 11, 18):
                    inner = types[inner][2]
                if types[inner][0] in (4, 5):
                    r = member_offset(inner, want)
                    if r:
                        return bits // 8 + r[0], r[1]
        return None

    task = find_struct("task_struct")
    r = member_offset(task, "thread")
    if r is None:
        raise AttachError("task_struct.thread not found in kernel BTF")
    r2 = member_offset(find_struct("thread_struct"), "fsbase")
    if r2 is None:
        raise AttachError("thread_struct.fsbase not found in kernel BTF (not x86-64?)")
    return r[0] + r2[0]


# ---------------------------------------------------------------------------------------------
# The API the probe programs and the daemon use

# pystack.h's folder, for `cflags()`'s -I: a path to the BPF sources, not an import of bpf/
PROGRAMS_DIR = Path(__file__).resolve().parent.parent / "bpf" / "programs"


class PythonStackReader:
    """Everything needed to record and name Python stacks of one process from BPF.

        r = PythonStackReader(pid)                 # raises UnsupportedVersion / AttachError
        b = BPF(src_file=..., cflags=r.cflags())   # program does #include "pystack.h"
        r.populate(b)                              # tid -> tstate map, if the program has one
        ...
        frames = r.symbolize(RawPyStack.from_struct(ev.st))   # tuple[Frame, ...], outermost first

    Thread-state discovery: glibc TSS slot read in BPF (`mode == "tls"`), calibrated here on
    the target; when that fails (musl, odd layouts) `mode == "map"`: BPF looks the tid up in
    `sl_py_threads`, filled by `populate()` and `refresh_threads()` (threads started later are
    missed until the next refresh). tests/bpf/test_pystack.py and docs/notes/python-stacks.md.
    """

    def __init__(self, pid: int, *, max_depth: int = 48, tag: bool = True,
                 mem: Optional[ProcessMemory] = None, procfs: Optional[ProcFS] = None,
                 btf_path: str = "/sys/kernel/btf/vmlinux", force_map: bool = False) -> None:
        from stacklens.pystacks.pysym import PySymbolizer

        self.pid = pid
        self.max_depth = max_depth
        self.tag = tag
        self.procfs = procfs or ProcFS()
        self.mem = mem or ProcMem(pid, self.procfs)
        self.interpreter = find_interpreter(pid, self.mem, self.procfs)
        self.layout = self.interpreter.layout
        self.fsbase_offset = kernel_fsbase_offset(btf_path)
        self.threads = walk_threads(self.mem, self.interpreter)
        self.tls_offset = None if force_map else calibrate_tls(self.mem, self.threads)
        self.mode = "tls" if self.tls_offset else "map"
        self.symbolizer = PySymbolizer(self.mem, self.layout, self.interpreter.code_type_addr)
        self._bpf = None
        self._table = "sl_py_threads"
        self._written: set[int] = set()   # host tids this reader put in the tid -> tstate map

    # -- compile side
    @staticmethod
    def include_dir() -> str:
        return str(PROGRAMS_DIR)

    def defines(self) -> dict[str, int]:
        d = dict(bpf_defines(self.layout))
        d.update(SL_PY_TGID=self.pid, SL_PY_INTERP=self.interpreter.main_interp,
                 SL_PY_TLS_OFF=self.tls_offset or 0, SL_TASK_FSBASE_OFF=self.fsbase_offset,
                 SL_PY_MAX_DEPTH=self.max_depth)
        return d

    # per process: from the targets map (struct sl_target) in a program that serves several
    PER_TARGET = ("SL_PY_TGID", "SL_PY_INTERP", "SL_PY_TLS_OFF")

    def target_params(self) -> tuple[int, int]:
        """(interpreter address, TLS offset or 0) for this process's `targets` entry."""
        return self.interpreter.main_interp, self.tls_offset or 0

    def program_cflags(self) -> list[str]:
        """`cflags()` without what names this process: the layout of its CPython build, which
        every process of that build shares (stacklens.h takes the rest from `targets`)."""
        return self.cflags(per_target=False)

    def cflags(self, per_target: bool = True) -> list[str]:
        flags = [f"-I{self.include_dir()}"]
        for k, v in self.defines().items():
            if not per_target and k in self.PER_TARGET:
                continue
            flags.append(f"-D{k}={v:#x}ULL" if v > 0x7FFFFFFF else f"-D{k}={v}")
        if not self.tag:
            flags.append("-DSL_PY_NO_TAG")
        return flags

    # -- maps
    def populate(self, bpf, table: str = "sl_py_threads") -> int:
        """Fill the tid -> tstate map if the program defines it; returns entries written."""
        self._bpf, self._table = bpf, table
        return self._fill(bpf, table)

    def _fill(self, bpf, table: str) -> int:
        try:
            tab = bpf.get_table(table.encode())
        except KeyError:
            return 0
        host = self.procfs.host_tids(self.pid)   # namespace tid (what CPython saw) -> host tid
        n = 0
        for t in self.threads:
            tid = host.get(t.native_tid)
            if tid:
                tab[tab.Key(tid)] = tab.Leaf(t.tstate)
                self._written.add(tid)
                n += 1
        return n

    def forget_threads(self, bpf, table: str = "sl_py_threads") -> None:
        """Removes the entries this reader wrote to the tid -> tstate map (a map the program
        shares with other processes, for the daemon's life): at detach, exited or not."""
        try:
            tab = bpf.get_table(table.encode())
        except KeyError:
            return
        written, self._written = self._written, set()
        for tid in written:
            try:
                del tab[tab.Key(tid)]
            except KeyError:
                pass

    def refresh_threads(self) -> list[PyThread]:
        """Re-walk the interpreter's thread list (new threads) and refresh the BPF map."""
        self.threads = walk_threads(self.mem, self.interpreter)
        if self._bpf is not None:
            self._fill(self._bpf, self._table)
        return self.threads

    # -- user side
    def symbolize(self, raw) -> tuple:
        """RawPyStack (or raw frames, innermost first) -> tuple[Frame, ...], outermost first."""
        return self.symbolizer.symbolize(raw)

    def struct_type(self):
        from stacklens.pystacks.pysym import sl_pystack_struct
        return sl_pystack_struct(self.max_depth)

    def describe(self) -> dict:
        i = self.interpreter
        return {"pid": self.pid, "path": i.path, "version": "%d.%d" % i.version,
                "layout_source": self.layout.source, "runtime": hex(i.runtime_addr),
                "interp": hex(i.main_interp), "mode": self.mode,
                "tls_offset": self.tls_offset, "threads": len(self.threads),
                "fsbase_offset": self.fsbase_offset}
