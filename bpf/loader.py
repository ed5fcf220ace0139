"""ProgramLoader: the BPF program one attacher uses, compiled or taken from POOL.

Builds the program's C text and -D parameters from a ProbeConfig (bpf/program.py), keys it by
everything that changes what is compiled and takes it from POOL when a program with that key is
compiled already (bpf/shared.py), else compiles it: 2-4 s of CPU (one BCC compile at a time per
process). Once per compiled program it fills the probe specs' map and loads the uprobe_multi entry
programs (kernel >= 6.6); without uprobe_multi the program has numbered per-probe stubs instead
and is never shared. Requires root (CAP_BPF + CAP_PERFMON) to load.
"""

from __future__ import annotations

import ctypes as ct
from typing import Callable

from stacklens.errors import AttachError

from stacklens.bpf import program
from stacklens.bpf.config import ProbeConfig
from stacklens.bpf.events_abi import SlSpec
from stacklens.bpf.ops import FALLBACK_OPS
from stacklens.bpf.shared import POOL, SharedProgram
from stacklens.bpf.spec import ProbeSpec
from stacklens.bpf.uprobe_multi import BPF_TRACE_UPROBE_MULTI, uprobe_multi_supported


class ProgramLoader:
    """The compiled program of one attacher: load() -> take() -> give_back(). `programs`: its
    uprobe_multi entry programs by role ("api_entry", "api_return", "op_entry", "autograd"),
    the ones that load() found last. `phase` is told of a compile, `note` gets the attach's notes."""

    def __init__(self, phase: Callable[[str], None], note: Callable[[str], None]):
        self._phase = phase
        self._note = note
        self.shared: SharedProgram | None = None   # the compiled program, shared (bpf/shared.py)
        self.bpf = None
        self.key: tuple = ()
        self.compiled = False      # the last load() compiled (not found in POOL)
        self.fallback = False      # per-probe perf-event uprobes (no uprobe_multi)
        self.source: program.ProgramSource | None = None
        self.programs: dict = {}

    def load(self, cfg: ProbeConfig, specs: list[ProbeSpec], py_flags: tuple[str, ...]) -> None:
        """The program this process needs: reused from POOL when one with the same settings is
        compiled already, else compiled (`py_flags`: pystack.h's, empty without Python stacks)."""
        self.fallback = cfg.force_fallback or not uprobe_multi_supported()
        if self.fallback:
            self._note("uprobe_multi unavailable: per-probe uprobes with a short op list "
                       f"({len(FALLBACK_OPS)} ops); detach takes ~0.1 s per probe")
        src = program.build_source(
            gpu=cfg.gpu, ops=cfg.ops, cpu=cfg.cpu_sample_hz > 0, native_stacks=cfg.native_stacks,
            python_stacks=bool(py_flags), pystack_cflags=py_flags, max_specs=max(64, len(specs)), ringbuf_pages=cfg.ringbuf_pages,
            api_stubs=len(specs) if self.fallback else 0,
            op_stubs=len(FALLBACK_OPS) if self.fallback else 0, autograd=cfg.ops and cfg.autograd)
        extra = tuple(cfg.extra_cflags) + (() if cfg.cfi_unwind else ("-DSL_STACK_COPY=0",))
        if extra:
            src = program.ProgramSource(src.text, src.cflags + extra)
        self.source = src
        # per-probe uprobes (the fallback) belong to the module they were attached through: not shared
        self.key = (src.text, src.cflags, tuple(bytes(s.bpf_spec()) for s in specs),
                    cfg.cpu_sample_hz, cfg.ringbuf_pages, id(self) if self.fallback else 0)
        compiled = []

        def build() -> SharedProgram:
            self._phase("compiling BPF")
            compiled.append(True)
            try:
                return SharedProgram(src, setup=lambda bpf: self._setup(bpf, cfg, specs),
                                     cpu_sample_hz=cfg.cpu_sample_hz, ringbuf_pages=cfg.ringbuf_pages)
            except Exception as e:
                raise AttachError(f"BPF compile failed: {e}; check kernel headers with `stacklens doctor`") from e

        self.shared = POOL.acquire(self.key, build)
        self.compiled = bool(compiled)
        if not compiled:
            self._note(f"BPF program: compiled before, shared with {self.shared.users - 1} other "
                       "attached process(es) or kept from an earlier attach")
        self.bpf = self.shared.bpf
        self.programs = self.shared.loaded

    def _setup(self, bpf, cfg: ProbeConfig, specs: list[ProbeSpec]) -> dict:
        """Once per compiled program: the probe specs and the uprobe_multi programs loaded."""
        from bcc import BPF  # imported here: no import-time side effects, tests without bcc still import

        if cfg.gpu:
            table = bpf.get_table(b"specs", keytype=ct.c_int, leaftype=SlSpec)
            for s in specs:
                table[table.Key(s.index)] = s.bpf_spec()
        loaded = {}
        if not self.fallback:
            names = []
            if cfg.gpu:
                names += [("api_entry", b"sl_api_entry_multi"), ("api_return", b"sl_api_return_multi")]
            if cfg.ops:
                names.append(("op_entry", b"sl_op_entry_multi"))
            if cfg.ops and cfg.autograd:
                names.append(("autograd", b"sl_autograd_multi"))
            for key, fn in names:
                loaded[key] = bpf.load_func(fn, BPF.KPROBE, attach_type=BPF_TRACE_UPROBE_MULTI)
        return loaded

    def take(self) -> SharedProgram | None:
        """The program, which from now on serves no new caller of `shared` (None: none loaded)."""
        shared, self.shared = self.shared, None
        return shared

    def give_back(self, shared: SharedProgram | None, usable: bool = True) -> None:
        """A taken program back to POOL for the next attach; discarded when it is not `usable`
        or has per-probe uprobes (they go with the module: bpf.cleanup)."""
        if shared is not None:
            if not usable or self.fallback:
                POOL.discard(self.key, shared)
            else:
                POOL.release(self.key, shared)
        self.bpf = None
