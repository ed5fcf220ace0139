"""What the probes cost the processes they run in, measured on this machine (issue 42).

A probe hit costs its target the uprobe trap (into the kernel and back: not a BPF program's run
time) plus the program's run. The kernel counts each program's run time once BPF statistics are
on (`RunStats`: BPF_ENABLE_STATS, while its fd is open, for every program on the node: two clock
reads per run). The trap has no counter: `measure_trap_ns` times it in a child process of its own,
calling a function of its own through ctypes with and without an empty program on it, in alternating
rounds. Both need root (CAP_BPF + CAP_PERFMON).
"""

from __future__ import annotations

import ctypes as ct
import os
import statistics
import subprocess
import sys
import textwrap

from stacklens.bpf.uprobe_multi import BPF_TRACE_UPROBE_MULTI, attach_uprobe_multi, bpf_syscall
from stacklens.introspect.procfs import ProcFS

BPF_PROG_LOAD = 5
BPF_ENABLE_STATS = 32
BPF_PROG_TYPE_KPROBE = 2
# r0 = 0; exit
_EMPTY_PROGRAM = bytes([0xB7, 0, 0, 0, 0, 0, 0, 0, 0x95, 0, 0, 0, 0, 0, 0, 0])


class _ProgLoadAttr(ct.Structure):
    _fields_ = [
        ("prog_type", ct.c_uint32),
        ("insn_cnt", ct.c_uint32),
        ("insns", ct.c_uint64),
        ("license", ct.c_uint64),
        ("log_level", ct.c_uint32),
        ("log_size", ct.c_uint32),
        ("log_buf", ct.c_uint64),
        ("kern_version", ct.c_uint32),
        ("prog_flags", ct.c_uint32),
        ("prog_name", ct.c_char * 16),
        ("prog_ifindex", ct.c_uint32),
        ("expected_attach_type", ct.c_uint32),
        ("_pad", ct.c_uint8 * 64),      # the rest of union bpf_attr, zeroed
    ]


def load_empty_uprobe_program() -> int:
    """An empty uprobe_multi program (no compiler needed); its fd."""
    insns = ct.create_string_buffer(_EMPTY_PROGRAM, len(_EMPTY_PROGRAM))
    lic = ct.create_string_buffer(b"GPL")
    attr = _ProgLoadAttr(prog_type=BPF_PROG_TYPE_KPROBE, insn_cnt=len(_EMPTY_PROGRAM) // 8,
                         insns=ct.addressof(insns), license=ct.addressof(lic), prog_name=b"sl_trap_cost",
                         expected_attach_type=BPF_TRACE_UPROBE_MULTI)
    return bpf_syscall(BPF_PROG_LOAD, attr, "BPF_PROG_LOAD of an empty program")


class RunStats:
    """BPF run-time statistics on for as long as this is open (for every program on the node)."""

    def __init__(self) -> None:
        attr = (ct.c_uint32 * 32)()          # type 0: BPF_STATS_RUN_TIME
        self.fd = bpf_syscall(BPF_ENABLE_STATS, attr, "BPF_ENABLE_STATS")

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    @staticmethod
    def of(prog_fd: int) -> tuple[int, int]:
        """(run_time_ns, run_cnt) of a program since statistics were first turned on for it."""
        got = ProcFS().fdinfo(os.getpid(), prog_fd)
        return int(got.get("run_time_ns", 0)), int(got.get("run_cnt", 0))


# The calibration child: a function of its own in a memfd mapped executable (push rbp; mov rbp,
# rsp; pop rbp; ret: the frame-pointer prologue library entry points start with; the probed
# instruction decides the trap's path: an emulated push, not a single step out of line), called
# through ctypes in a loop.
_FUNCTION = bytes([0x55, 0x48, 0x89, 0xE5, 0x5D, 0xC3])
_CHILD = textwrap.dedent("""
    import ctypes, mmap, os, sys, time
    fd = os.memfd_create("stacklens-trap-cost")
    os.write(fd, FUNCTION.ljust(mmap.PAGESIZE, b"\\xcc"))
    libc = ctypes.CDLL(None)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    addr = libc.mmap(None, mmap.PAGESIZE, mmap.PROT_READ | mmap.PROT_EXEC, mmap.MAP_PRIVATE, fd, 0)
    fn = ctypes.CFUNCTYPE(None)(addr)
    print("ready", fd, flush=True)
    for line in sys.stdin:
        n = int(line)
        c0 = time.thread_time_ns()
        for _ in range(n):
            fn()
        print(time.thread_time_ns() - c0, flush=True)
""").replace("FUNCTION", repr(_FUNCTION))


def measure_trap_ns(calls: int = 100_000, rounds: int = 5) -> float:
    """The uprobe trap's cost per hit on this machine, in ns of the hit thread's CPU time: the
    median over `rounds` of (CPU per call with an empty program on getppid) - (without)."""
    child = subprocess.Popen([sys.executable, "-I", "-c", _CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True)
    prog = -1
    try:
        said = child.stdout.readline().split()
        if len(said) != 2 or said[0] != "ready":
            raise OSError("the calibration process did not start")
        path, off = ProcFS().fd_path(child.pid, int(said[1])), 0
        prog = load_empty_uprobe_program()

        def per_call() -> float:
            child.stdin.write(f"{calls}\n")
            child.stdin.flush()
            return int(child.stdout.readline()) / calls

        per_call()                            # warm
        diffs = []
        for i in range(rounds):
            link = -1
            try:
                first_off = i % 2 == 0        # alternate the order: drift cancels
                a = per_call() if first_off else None
                link = attach_uprobe_multi(prog, path, [off], [0], pid=child.pid)
                on = per_call()
                os.close(link)
                link = -1
                b = per_call() if not first_off else a
                diffs.append(on - b)
            finally:
                if link >= 0:
                    os.close(link)
        return max(0.0, statistics.median(diffs))
    finally:
        if prog >= 0:
            os.close(prog)
        child.kill()
        child.wait()
        for f in (child.stdin, child.stdout):
            f.close()
