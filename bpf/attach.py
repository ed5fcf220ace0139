"""ProbeAttacher: the stacklens BPF program compiled (or taken from POOL) for one process and its
probes attached: uprobes on the GPU API and libtorch (uprobe_multi links, per-probe perf-event
uprobes otherwise), the CPU sampler's target entry, rescans for libraries loaded later, detach.

The attacher runs the steps and holds the process's state (its target slot, Python stack reader,
notes, counts); the parts each do one job: bpf/loader.py the program (source, POOL, compile),
bpf/scan.py which libraries and sites get probes, bpf/placer.py the probes placed on them,
bpf/readout.py what the program holds for this process. ProbeConfig is bpf/config.py's.

Requires root (CAP_BPF + CAP_PERFMON + CAP_SYS_PTRACE for /proc/PID/root), kernel >= 6.6 for
uprobe_multi (per-probe perf-event uprobes otherwise, with a short op list). A compile is 2-4 s
of CPU (one per program key, bpf/shared.py); an attach of a compiled program ~50 ms plus ~1 ms
per library; a rescan reads /proc/PID/maps once.
"""

from __future__ import annotations

import time
from typing import Callable

from stacklens.errors import (AttachError, InputError, NoSuchProcess, NotApplicable, PermissionDenied,
                              StacklensError, UnsupportedVersion)
from stacklens.introspect.procfs import ProcFS, check_pid

from stacklens.bpf import program
from stacklens.bpf.config import ProbeConfig
from stacklens.bpf.loader import ProgramLoader
from stacklens.bpf.placer import ProbePlacer
from stacklens.bpf.py_stacks import PY_MAX_DEPTH
from stacklens.bpf.readout import BpfMaps, ProgramReadout
from stacklens.bpf.report import LibraryAttach
from stacklens.bpf.scan import LibraryScanner
from stacklens.bpf.spec import ProbeSpec, load_specs
from stacklens.bpf.uprobe_multi import uprobe_multi_supported


def python_reader(pid: int):
    """(PythonStackReader, note) for a supported CPython target, else (None, why not)."""
    from stacklens.pystacks.python_process import PythonStackReader

    try:
        r = PythonStackReader(pid, max_depth=PY_MAX_DEPTH)
    except UnsupportedVersion as e:
        return None, f"python stacks: not applicable: {e}"
    except NoSuchProcess:
        raise
    except (StacklensError, OSError, ValueError) as e:   # MemoryReadError is both
        return None, f"python stacks: unavailable ({e}); events carry an empty py_stack"
    d = r.describe()
    return r, (f"python stacks: CPython {d['version']} ({d['layout_source']} layout, "
               f"{d['mode']} thread-state lookup)")


class ProbeAttacher:
    """The probes of one process: attach() -> rescan()* -> detach(); detach is idempotent.
    `phase` is told each step of an attach ("compiling BPF", …)."""

    def __init__(self, pid: int, config: ProbeConfig, phase: Callable[[str], None] = lambda name: None):
        self.pid = pid
        self.config = config
        self._phase = phase
        self.slot = -1             # this process's counter slot in the program
        self.specs: list[ProbeSpec] = []
        self.py = None             # PythonStackReader when Python stacks are captured
        self.last_scan = 0.0
        self.counts = {"rescans": 0, "py_unsupported": 0}
        self.notes: list[str] = []
        self.program = ProgramLoader(phase, self._note)
        self.placer = ProbePlacer(pid, self.program)
        self.scanner = LibraryScanner(pid, self.placer, self._note)
        self.readout = ProgramReadout(pid)

    def _note(self, text: str) -> None:
        self.notes.append(text)

    # what bpf/session.py reads of the parts: the program, the links, what the scans found
    @property
    def shared(self):
        return self.program.shared

    @property
    def bpf(self):
        return self.program.bpf

    @property
    def source(self) -> program.ProgramSource | None:
        return self.program.source

    @property
    def compiled(self) -> bool:
        return self.program.compiled

    @property
    def fallback(self) -> bool:
        return self.program.fallback

    @property
    def links(self) -> list[int]:
        return self.placer.links

    @property
    def libraries(self) -> list[LibraryAttach]:
        return self.scanner.libraries

    @property
    def op_names(self) -> list[str]:
        """Op index -> name (the decoder reads the same list)."""
        return self.scanner.op_names

    @property
    def vtables(self):
        return self.scanner.vtables

    @property
    def _api_entry(self):
        """The API entry program, None without one (benchmarks/bench_launch_cost.py reads its fd)."""
        return self.program.programs.get("api_entry")

    def attach(self) -> None:
        """Compiles (or takes from POOL) the program, attaches the probes and makes the program
        serve this process; on any failure nothing stays attached and the error says why."""
        check_pid(self.pid)
        self.notes = []
        self.scanner.libraries = []
        if self.config.only_mapped:
            self.config = self.scanner.only_mapped(self.config)
        cfg = self.config
        self.specs = load_specs(cfg.spec_path) if cfg.gpu else []
        for s in self.specs:
            s.decoder()               # compiled now, not at its first event
        try:
            self._phase("reading the target")
            self._load()
            self._phase("attaching probes")
            self.scanner.scan(cfg, self.specs, initial=True)
            if cfg.cpu_sample_hz > 0:
                self._phase("starting CPU sampling")
            interp, tls = (0, 0)
            if self.py is not None:
                interp, tls = self.py.target_params()
                self.py.populate(self.bpf)   # the tid -> tstate map (threads TLS misses)
            # from here the program serves this process (and the CPU sampler runs for it)
            self.slot = self.shared.add_target(self.pid, interp, tls)
            # the process may have exited while we attached: then nothing must stay attached
            check_pid(self.pid)
        except BaseException as e:
            self.detach()
            if isinstance(e, (NoSuchProcess, PermissionDenied, InputError, NotApplicable, AttachError)):
                raise
            if isinstance(e, FileNotFoundError) or not ProcFS().exists(self.pid):
                raise NoSuchProcess(f"process {self.pid} exited during attach; nothing was left attached") from e
            raise AttachError(f"attach to {self.pid} failed: {e}; run `stacklens doctor` to check "
                              f"kernel headers, tracefs and BPF permissions") from e
        self.last_scan = time.monotonic()

    def maps(self) -> BpfMaps:
        """The maps the ring decoder reads, of the program attached now."""
        return BpfMaps(self.bpf, self.py is not None)

    def prepare(self) -> bool:
        """Compiles (or finds in POOL) the program an attach to this process would use, and
        attaches nothing to it. True when it compiled one."""
        check_pid(self.pid)
        if self.config.force_fallback or not uprobe_multi_supported():
            return False              # per-probe programs are never shared: nothing to prepare
        self.specs = load_specs(self.config.spec_path) if self.config.gpu else []
        try:
            self._load()
            return self.program.compiled
        finally:
            # the program goes back to POOL; nothing of this process was added to it
            self.program.give_back(self.program.take())
            py, self.py = self.py, None
            if py is not None:
                py.mem.close()

    def _load(self) -> None:
        """The program this process needs (bpf/loader.py), with the Python stack reader and
        pystack.h's parameters for it where the target's CPython is supported."""
        cfg = self.config
        py_flags: tuple[str, ...] = ()
        self.py = None
        if cfg.python_stacks and program.pystack_available():
            self.py, note = python_reader(self.pid)
            self.notes.append(note)
            if self.py is None:
                self.counts["py_unsupported"] += 1
            else:
                py_flags = tuple(self.py.program_cflags()) + tuple(cfg.pystack_cflags)
        self.program.load(cfg, self.specs, py_flags)

    def rescan(self) -> list[LibraryAttach]:
        """Attach to libraries the process mapped since the last scan; returns what was added."""
        before = len(self.libraries)
        if self.py is not None and self.py.mode == "map":
            self.py.refresh_threads()  # threads started since: tid -> tstate
        self.scanner.scan(self.config, self.specs, initial=False)
        self.counts["rescans"] += 1
        self.last_scan = time.monotonic()
        return self.libraries[before:]

    # ------------------------------------------------------------------ what the program holds
    def op_hash_counts(self) -> list[tuple[int, int]]:
        """(path hash, calls) of this process's paths (bpf/readout.py)."""
        return self.readout.op_hash_counts(self.shared)

    def pending_records(self) -> list[bytes] | None:
        """The raw entry events of this process's return-probed calls not yet returned; None
        when they cannot be read (bpf/readout.py)."""
        return self.readout.pending_records(self.bpf)

    # ------------------------------------------------------------------ detach
    def detach(self) -> None:
        """Remove every probe; safe to call twice and after a failed attach. The compiled
        program goes back to POOL for the next attach."""
        self.placer.close()
        shared = self.program.take()
        usable = True
        if shared is not None:
            try:
                shared.remove_target(self.pid, self.slot)
                if self.py is not None:
                    self.py.forget_threads(shared.bpf)
            except Exception:  # noqa: BLE001 — an unusable program is not reused
                usable = False
        self.program.give_back(shared, usable)
        self.slot = -1
        py, self.py = self.py, None
        if py is not None:
            try:
                py.mem.close()
            except Exception:
                pass
