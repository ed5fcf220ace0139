"""ProbeSession: attach the stacklens BPF programs to one running process by PID.

A facade over bpf/attach.py (ProbeAttacher: compile, attach, rescan, detach) and bpf/decode.py
(RingDecoder: ring records -> Events with symbolized frames).

Requires root (CAP_BPF + CAP_PERFMON + CAP_SYS_PTRACE for /proc/PID/root), kernel >= 6.6 for
uprobe_multi (per-probe perf-event uprobes otherwise, with a short op list).
Overhead (measured on the 2-core Firecracker VM, docs/benchmarks/probes.md): one uprobe hit per
GPU API call and per libtorch op call (~3 µs each here), 99 Hz per CPU for samples.
"""

from __future__ import annotations

import gc
import time

from stacklens.errors import NoSuchProcess
from stacklens.introspect.procfs import ProcFS

from stacklens.bpf.attach import ProbeAttacher, ProbeConfig
from stacklens.bpf.decode import COUNTS, RecordList, RingDecoder
from stacklens.bpf.events_abi import COUNTERS
from stacklens.bpf.procmaps import NativeSymbolizer
from stacklens.bpf.report import AttachReport, LibraryAttach
from stacklens.records.events import Event

# one poll decodes at most this long (to a ring commit, 1 MiB): a CPU sample's CFI walk costs
# ~0.2-2 ms, and a reader far behind must still answer its session's requests between polls
POLL_DECODE_S = 0.25


class ProbeSession:
    """Probes of one process. attach() -> poll()* -> detach(); detach is idempotent."""

    # progress of attach(): called with a phase name ("compiling BPF", …); None: silent
    on_phase = None

    def __init__(self, pid: int, config: ProbeConfig = ProbeConfig()):
        self.pid = pid
        self.config = config
        self._attacher = ProbeAttacher(pid, config, phase=self._phase)
        self._decoder: RingDecoder | None = None   # from the first attach on
        self.attached = False

    def _phase(self, name: str) -> None:
        if self.on_phase is not None:
            self.on_phase(name)

    @property
    def _shared(self):
        """The compiled program (bpf/shared.py), None while detached: daemon/core.py counts its users."""
        return self._attacher.shared

    # ------------------------------------------------------------------ attach
    def attach(self) -> AttachReport:
        if self.attached:
            from stacklens.errors import AlreadyAttached
            raise AlreadyAttached(f"this session is already attached to {self.pid}; detach() first")
        t0 = time.perf_counter()
        a = self._attacher
        a.attach()
        py = a.py.symbolizer if a.py is not None else None
        decoder = RingDecoder(self.pid, a.maps(), NativeSymbolizer(self.pid), specs=a.specs, py=py,
                              py_max_depth=a.py.max_depth if a.py is not None else 0,
                              op_names=a.op_names, vtables=a.vtables)
        if self._decoder is not None:
            decoder.carry_from(self._decoder)
        self._decoder = decoder
        self.attached = True
        cfg = self.config
        n = sum(lib.probes for lib in a.libraries)
        return AttachReport(self.pid, tuple(a.libraries), n, cfg.cpu_sample_hz,
                            time.perf_counter() - t0, tuple(a.notes),
                            "perf_event" if a.fallback else "uprobe_multi", a.py is not None)

    def prepare(self) -> bool:
        """Compiles (or finds in POOL) the program an attach to this process would use, and
        attaches nothing to it: the daemon does this ahead of the first attach, since a compile
        is most of an attach (3-9 s of a busy 2-vCPU machine). True when it compiled one."""
        return self._attacher.prepare()

    def preload_symbols(self) -> int:
        """Read the symbol table of every file the process maps executable now rather than at
        its first sample (`record`, while the program is held): the first samples then decode at
        once, before a program that is starting up frees the code objects of the modules it was
        importing. Returns how many files were read."""
        if self._decoder is None:
            return 0
        sym = self._decoder.native
        seen = set()
        for m in ProcFS().maps(self.pid):
            if "x" in m.perms and m.path.startswith("/") and m.path not in seen:
                seen.add(m.path)
                sym.frame(m.start)
        return len(seen)

    def rescan(self) -> list[LibraryAttach]:
        """Attach to libraries the process mapped since the last scan; returns what was added."""
        return self._attacher.rescan()

    # ------------------------------------------------------------------ events
    def poll(self, timeout_ms: int = 100, max_events: int = 1 << 20) -> list[Event]:
        """Decoded events since the last poll (waits up to timeout_ms when none are ready).
        While this process is the program's only target its records are decoded straight from
        the mapped ring; otherwise the ring is sorted into per-process queues first."""
        a = self._attacher
        shared = a.shared
        if not self.attached or shared is None:
            return []
        if self.config.rescan_interval_s and time.monotonic() - a.last_scan > self.config.rescan_interval_s:
            try:
                a.rescan()
            except (NoSuchProcess, FileNotFoundError):
                a.last_scan = time.monotonic()
        reader = shared.reader
        if timeout_ms and not reader.available() and not shared.queued(self.pid):
            reader.wait(timeout_ms)
        decode = self._decoder.decode
        # the loop allocates only acyclic objects: pausing the cyclic GC saves ~25% per event
        was_enabled = gc.isenabled()
        gc.disable()
        try:
            with shared.lock:
                # events the ring refused (sl_emit in stacklens.h): rare; one epoll_wait(0) per poll
                shared.poll_fallback()
                sole = shared.sole(self.pid)
                if not sole:
                    shared.sort_ring()
                # what was sorted out for this process before (by another session's poll, or
                # the fallback) is older than what is still in the ring: decoded first
                queued = shared.take(self.pid)
                out = decode(RecordList(queued), 1 << 30) if queued else []
                if sole:
                    out += decode(reader, max_events, POLL_DECODE_S)
            return out
        finally:
            if was_enabled:
                gc.enable()

    def in_flight(self) -> list[Event]:
        """The return-probed calls entered and not yet returned (a sync still waiting), as their
        entry events (duration 0): what a window that ends now would otherwise never see."""
        if self._attacher.bpf is None or self._decoder is None:
            return []
        records = self._attacher.pending_records()
        return self._decoder.decode(RecordList(records), 1 << 30) if records else []

    # ------------------------------------------------------------------ aggregates / stats
    def op_counts(self) -> dict[tuple[str, ...], int]:
        """Operator calls counted in the kernel, by operator path (outermost first)."""
        if self._attacher.bpf is None or not self.config.ops or self._decoder is None:
            return {}
        out: dict[tuple[str, ...], int] = {}
        for h, n in self._attacher.op_hash_counts():
            path = self._decoder.op_path(h)
            out[path] = out.get(path, 0) + n
        return out

    @property
    def libraries(self) -> tuple[LibraryAttach, ...]:
        """Every library file found so far (attach and rescans), with its probe count."""
        return tuple(self._attacher.libraries)

    def kernel_names(self) -> dict[int, str]:
        return dict(self._decoder.names) if self._decoder is not None else {}

    def read_notes(self) -> list[str]:
        """The profile's notes on what was read from the target and could not be used
        (RingDecoder.read_notes). [] when all went well."""
        return self._decoder.read_notes() if self._decoder is not None else []

    def stats(self) -> dict[str, int]:
        a = self._attacher
        decoded = self._decoder.counts if self._decoder is not None else dict.fromkeys(COUNTS, 0)
        out = {name: 0 for name in COUNTERS}
        if a.shared is not None and a.slot >= 0:
            out.update(a.shared.counters(a.slot))
        if a.bpf is not None and self.config.ops:
            # counted per op path (the op probe keeps no separate per-hit counter)
            out["op_calls"] = sum(n for _, n in a.op_hash_counts())
        out["unwind_errors"] = out["stack_errors"] + decoded["stack_lookup_failures"]
        out.update(decoded)
        out.update(a.counts)
        out["links"] = len(a.links)
        if a.shared is not None:
            out["fallback_full"] = a.shared.fallback_full   # the program's (not told apart by process)
            out["unpolled_drops"] = a.shared.dropped.get(self.pid, 0)
        if a.py is not None and self._decoder is not None:
            out.update(self._decoder.py_stats())
        return out

    def program_fds(self) -> dict[str, int]:
        """The loaded programs whose hits this session counts, by kind ("api", "op", "cpu"), for
        their run-time statistics (bpf/costs.py); per-probe stubs (the fallback) are left out."""
        a, out = self._attacher, {}
        loaded = a.program.programs    # the uprobe_multi entry programs (bpf/loader.py)
        for kind, prog in (("api", loaded.get("api_entry")), ("op", loaded.get("op_entry"))):
            if prog is not None:
                out[kind] = prog.fd
        funcs = getattr(a.bpf, "funcs", {}) if a.bpf is not None else {}
        if b"sl_cpu_sample" in funcs:
            out["cpu"] = funcs[b"sl_cpu_sample"].fd
        return out

    @property
    def source(self) -> str:
        """The C text and cflags this session compiled (`--dump-bpf`)."""
        return self._attacher.source.render()

    # ------------------------------------------------------------------ detach
    def detach(self) -> None:
        """Remove every probe; safe to call twice and after a failed attach. The compiled
        program goes back to POOL for the next attach."""
        self._attacher.detach()
        self.attached = False

    def __enter__(self) -> "ProbeSession":
        self.attach()
        return self

    def __exit__(self, *exc) -> None:
        self.detach()
