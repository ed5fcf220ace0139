"""One compiled BPF program serving every process attached with the same settings.

BCC compiles a program in 2-4 s of CPU (clang; 8-15 s of wall time on a busy 2-vCPU VM) and cannot
load one compile twice, so a program is compiled once per daemon and program key (the C text
and cflags: which probes, the CPython layout, ring size) and kept in `POOL`; each attached
process is an entry of its `targets` map (stacklens.h `struct sl_target`: its counter slot, its
interpreter address and TLS offset) plus its own uprobe links. One ring buffer per program:
`Consumer` hands a session its process's records, straight from the mapped ring while it is the
only target, else sorted out by `sl_event.pid` (name events carry it at the same offset).

Requires root (CAP_BPF + CAP_PERFMON). The CPU sampler is a perf event on every CPU, attached
while the program serves a target and filtered in BPF by the `targets` lookup (one hash lookup
per probe hit, ~50 ns). A program nobody uses has no link and no perf event: it holds only its
maps, until `POOL` keeps more than MAX_IDLE of them. The maps' sizes are what one process had
before (16 MiB ring, 4,096 parked calls, 65,536 op paths, the stack maps): one very busy target
can fill them for all (drops, full maps and lost stacks are counted per target).
"""

from __future__ import annotations

import collections
import ctypes as ct
import os
import struct
import threading
from typing import Callable

from stacklens.bpf import program
from stacklens.bpf.events_abi import COUNTERS, SL_NCOUNTERS, SlEvent, SlTarget
from stacklens.bpf.ringbuf import BUSY, DISCARD, RingBufReader
from stacklens.errors import AttachError

PERF_TYPE_SOFTWARE = 1
PERF_COUNT_SW_CPU_CLOCK = 0
FALLBACK_PAGES = 16      # per-CPU perf buffer for events the ring refused (sl_emit)
MAX_IDLE = 2             # programs kept while no process uses them
MAX_QUEUED = 1 << 16     # records held for a session that has not polled yet (~20 MiB; then counted, dropped)
_REC_HEAD = struct.Struct("<IIII")   # ring record: length | flags, page offset; event kind, spec
_PID = struct.Struct("<I")
_PID_OFF = 16            # ring header (8) + sl_event.pid (8), sl_name_event.pid likewise
# a fallback record: an event, and for a CPU sample its addresses (SL_SAMPLE_DEPTH of them), its
# registers and at most 32 KiB of its stack
FALLBACK_RECORD_MAX = ct.sizeof(SlEvent) + 8 * 127 + 8 * 22 + 32768  # + regs and stack copy (cpu.bpf.c)


class SharedProgram:
    """A compiled module, its ring, and the processes it serves (pid -> counter slot)."""

    def __init__(self, src: program.ProgramSource, *, setup: Callable, cpu_sample_hz: int,
                 ringbuf_pages: int) -> None:
        self.source = src
        self.bpf = program.compile_bpf(src)
        self.lock = threading.RLock()     # the ring, the queues and the targets
        self.users = 0
        try:
            self.loaded = setup(self.bpf)  # name -> loaded program (uprobe_multi programs, specs)
            self._hz = cpu_sample_hz
            self._perf = False
            self._slots: dict[int, int] = {}
            self._queues: dict[int, list[bytes]] = collections.defaultdict(list)
            self.dropped: collections.Counter[int] = collections.Counter()
            self.orphans = 0              # records of a process no longer served (just detached)
            self.ring_bytes = ringbuf_pages * os.sysconf("SC_PAGE_SIZE")
            self.reader = RingBufReader(self.bpf[b"events"].map_fd, self.ring_bytes)
            self.fallback_full = 0
            self.bpf[b"events_fb"].open_perf_buffer(self._on_fallback, page_cnt=FALLBACK_PAGES,
                                                    lost_cb=self._on_fallback_full)
            self._targets = self.bpf.get_table(b"targets", keytype=ct.c_uint32, leaftype=SlTarget)
            self._counters = self.bpf[b"counters"]
            self._op_slots = None
        except BaseException:
            self.close()
            raise

    # -- targets -------------------------------------------------------------------------
    def add_target(self, pid: int, py_interp: int = 0, py_tls_off: int = 0) -> int:
        """Serve `pid` from now on; returns its counter slot (zeroed)."""
        with self.lock:
            used = set(self._slots.values())
            slot = next((s for s in range(program.MAX_TARGETS) if s not in used), None)
            if slot is None:
                raise AttachError(f"one BPF program serves at most {program.MAX_TARGETS} processes; "
                                  "detach one first")
            self._zero_counters(slot)
            self._queues.pop(pid, None)
            self._targets[ct.c_uint32(pid)] = SlTarget(slot, pid, py_interp, py_tls_off)
            self._slots[pid] = slot
            if self._hz > 0 and not self._perf:
                self.bpf.attach_perf_event(ev_type=PERF_TYPE_SOFTWARE, ev_config=PERF_COUNT_SW_CPU_CLOCK,
                                           fn_name=b"sl_cpu_sample", sample_freq=int(self._hz))
                self._perf = True
            return slot

    def remove_target(self, pid: int, slot: int) -> None:
        """Stop serving `pid`, if `slot` (what add_target returned) is still its: its entry, its
        queued records, its in-flight calls and op paths; once no target is left, the stack maps
        too (they never free a bucket, and the program lives as long as the daemon)."""
        with self.lock:
            if self._slots.get(pid) != slot:
                return
            del self._slots[pid]
            try:
                del self._targets[ct.c_uint32(pid)]
            except KeyError:
                pass
            self._queues.pop(pid, None)
            if not self._slots and self._perf:
                self.bpf.detach_perf_event(ev_type=PERF_TYPE_SOFTWARE, ev_config=PERF_COUNT_SW_CPU_CLOCK)
                self._perf = False
            self._forget(pid)
            if not self._slots:
                for name in (b"stacks", b"stacks2", b"native_memo"):
                    try:
                        self.bpf[name].clear()
                    except KeyError:
                        pass

    def _forget(self, pid: int) -> None:
        """What the process left in the shared maps: its parked calls, its op paths and the
        op-count slots they claimed (a claimed slot would push later paths into the overflow map)."""
        def delete(table, keys) -> None:
            for k in keys:
                try:
                    del table[k]
                except KeyError:          # gone meanwhile (a parked call returned)
                    pass

        try:
            pending = self.bpf[b"pending"]
        except KeyError:
            pending = None
        if pending is not None:
            delete(pending, [k for k, v in pending.items() if v.pid == pid])
        try:
            paths = self.bpf[b"op_paths"]
        except KeyError:
            return
        mine = {k.value for k, v in paths.items() if v.tgid == pid}
        delete(paths, [ct.c_uint64(h) for h in mine])
        delete(self.bpf[b"op_counts"], [ct.c_uint64(h) for h in mine])
        slots = self.bpf[b"op_slots"]
        view = self.op_slots_view()
        for i in range(0, len(view), 2):
            if view[i] in mine:
                slots[slots.Key(i // 2)] = slots.Leaf(0, 0)

    def sole(self, pid: int) -> bool:
        return len(self._slots) == 1 and pid in self._slots

    @property
    def targets(self) -> tuple[int, ...]:
        return tuple(self._slots)

    # -- records ---------------------------------------------------------------------------
    def queued(self, pid: int) -> bool:
        """Records sorted out for `pid` wait (a poll need not wait for the ring)."""
        return bool(self._queues.get(pid))

    def take(self, pid: int) -> list[bytes]:
        """The records queued for `pid` (call with the lock held)."""
        return self._queues.pop(pid, [])

    def sort_ring(self) -> None:
        """Moves every record in the ring into its process's queue (call with the lock held)."""
        data, mask = self.reader.data, self.reader.mask
        cons, prod = self.reader.positions()
        head, pid_at = _REC_HEAD.unpack_from, _PID.unpack_from
        queues, slots = self._queues, self._slots
        while cons < prod:
            off = cons & mask
            ln = head(data, off)[0]
            if ln & BUSY:
                break
            size = ln & 0x3FFFFFFF
            cons += (size + 15) & ~7
            if ln & DISCARD:
                continue
            self._queue(pid_at(data, off + _PID_OFF)[0], bytes(data[off + 8:off + 8 + size]), queues, slots)
        self.reader.commit(cons)

    def _queue(self, pid: int, rec: bytes, queues, slots) -> None:
        if pid not in slots:
            self.orphans += 1
        elif len(queues[pid]) >= MAX_QUEUED:
            self.dropped[pid] += 1
        else:
            queues[pid].append(rec)

    def poll_fallback(self) -> None:
        self.bpf.perf_buffer_poll(0)

    def _on_fallback(self, _cpu, data, size) -> None:
        # the perf record's size includes padding, which the decode's bounds ignore
        rec = ct.string_at(data, min(size, FALLBACK_RECORD_MAX))
        self._queue(_PID.unpack_from(rec, _PID_OFF - 8)[0], rec, self._queues, self._slots)

    def _on_fallback_full(self, lost: int) -> None:
        self.fallback_full += lost

    # -- per-target counters -------------------------------------------------------------
    def counters(self, slot: int) -> dict[str, int]:
        t = self._counters
        return {name: int(sum(t[t.Key(slot * SL_NCOUNTERS + i)])) for i, name in enumerate(COUNTERS)}

    def _zero_counters(self, slot: int) -> None:
        t = self._counters
        zero = t.Leaf(*([0] * len(t.Leaf())))
        for i in range(SL_NCOUNTERS):
            t[t.Key(slot * SL_NCOUNTERS + i)] = zero

    def op_slots_view(self) -> memoryview:
        """op_slots as u64 pairs (hash, count), mapped once."""
        if self._op_slots is None:
            import mmap

            table = self.bpf[b"op_slots"]
            size = table.max_entries * ct.sizeof(table.Leaf)
            mm = mmap.mmap(table.map_fd, size, mmap.MAP_SHARED, mmap.PROT_READ)
            self._op_slots = (mm, memoryview(mm).cast("Q"))
        return self._op_slots[1]

    def close(self) -> None:
        slots, self._op_slots = getattr(self, "_op_slots", None), None
        if slots is not None:
            try:
                slots[1].release()
                slots[0].close()
            except (BufferError, ValueError):
                pass
        reader = getattr(self, "reader", None)
        if reader is not None:
            reader.close()
            self.reader = None
        try:
            self.bpf.cleanup()
        except Exception:  # noqa: BLE001 — closing must not raise over an attach error
            pass


class ProgramPool:
    """Compiled programs by key; each compiled once and reused while the daemon lives (the idle
    ones beyond MAX_IDLE are closed, oldest first)."""

    def __init__(self, max_idle: int = MAX_IDLE) -> None:
        self._lock = threading.Lock()
        self._programs: dict[tuple, SharedProgram] = {}
        self._idle: collections.OrderedDict[tuple, None] = collections.OrderedDict()
        self._building: dict[tuple, threading.Event] = {}
        self.max_idle = max_idle
        self.compiles = 0

    def acquire(self, key: tuple, build: Callable[[], SharedProgram]) -> SharedProgram:
        """The program of `key`, compiled by `build` if there is none yet (one compile per key:
        a second attach waits for the first one's compile instead of starting its own)."""
        while True:
            with self._lock:
                prog = self._programs.get(key)
                if prog is not None:
                    prog.users += 1
                    self._idle.pop(key, None)
                    return prog
                wait = self._building.get(key)
                if wait is None:
                    self._building[key] = threading.Event()
                    break
            wait.wait()
        prog = None
        try:
            prog = build()
            self.compiles += 1
        finally:
            with self._lock:
                done = self._building.pop(key)
                if prog is not None:
                    prog.users = 1
                    self._programs[key] = prog
            done.set()                # a failed build: the waiters try (and fail) themselves
        return prog

    def release(self, key: tuple, prog: SharedProgram) -> None:
        close = []
        with self._lock:
            prog.users -= 1
            if prog.users > 0:
                return
            if self._programs.get(key) is not prog:     # discarded while in use: its last user
                close.append(prog)
            else:
                self._idle[key] = None
            while len(self._idle) > self.max_idle:
                old, _ = self._idle.popitem(last=False)
                close.append(self._programs.pop(old))
        for p in close:
            p.close()

    def close_idle(self) -> int:
        """Closes every program no process uses (daemon shutdown; leak checks). Returns how many."""
        with self._lock:
            idle = [self._programs.pop(k) for k in self._idle]
            self._idle.clear()
        for p in idle:
            p.close()
        return len(idle)

    def discard(self, key: tuple, prog: SharedProgram) -> None:
        """Gives up one use of a program that must not be reused (a detach failed halfway, or
        its per-probe uprobes are its own): no new attach gets it, and it closes when its last
        user is gone."""
        with self._lock:
            prog.users -= 1
            if self._programs.get(key) is prog:
                del self._programs[key]
                self._idle.pop(key, None)
            last = prog.users <= 0
        if last:
            prog.close()


POOL = ProgramPool()
