"""LibraryScanner: which libraries of one process get probes, and where in them.

GPU API and collective probes (bpf/probes.toml) on every exported version of their symbols in
libcuda/libamdhip64/libtorch_cpu (bpf/spec.py resolve_library), operator probes on libtorch_cpu's
at::_ops::*::call (bpf/ops.py), the forward→backward link's entry points and the autograd node
classes' vtables (bpf/autograd.py); bpf/placer.py places the probes. Also which of those an attach
compiles in at all (`only_mapped`) and whether the process is a torch.distributed rank.

Reads /proc/PID/maps once per scan and the library files through /proc/PID/root (root:
CAP_SYS_PTRACE); a file's symbols are read once (cached per file: libtorch_cpu's 200k symbols
~0.4 s on the 2-vCPU machine, once per daemon), so a rescan that finds nothing new costs one
read of the maps.
"""

from __future__ import annotations

import dataclasses
import os
import re
from typing import Callable

from stacklens.errors import StacklensError
from stacklens.introspect.procfs import ProcFS

from stacklens.bpf import autograd
from stacklens.bpf.config import ProbeConfig
from stacklens.bpf.ops import FALLBACK_OPS, LIBTORCH_RE, OpSymbol, find_op_symbols, select_ops
from stacklens.bpf.placer import ProbePlacer
from stacklens.bpf.procmaps import LibraryFile, find_libraries
from stacklens.bpf.report import LibraryAttach
from stacklens.bpf.spec import ProbeSpec, resolve_library

_NODE_LIBS_RE = re.compile(r"^libtorch_(python|cuda|hip)\.so")
_ROLE = {"libcuda": "cuda", "libamdhip64": "hip", "libtorch_cpu": "c10d"}
GPU_DRIVER_RE = re.compile(r"libcuda\.so|libamdhip64\.so")


class LibraryScanner:
    """The library files of one process found so far and what was attached to each: scan()
    attaches a file once ("api" and "ops" apart: libtorch_cpu gets both). `op_names` (op index ->
    name) and `vtables` (autograd node classes) grow with the files: the ring decoder reads the
    same objects. `note` gets the attach's notes."""

    def __init__(self, pid: int, placer: ProbePlacer, note: Callable[[str], None]):
        self.pid = pid
        self.placer = placer
        self._note = note
        self.libraries: list[LibraryAttach] = []
        self.op_names: list[str] = []
        self.vtables = autograd.VtableNames()   # autograd node classes by vtable pointer
        # (what was attached: "api" or "ops", the library's key): libtorch_cpu gets both
        self._attached_files: set[tuple[str, tuple[str, int]]] = set()
        self._rank: bool | None = None   # a torch.distributed rank (RANK set): read at the first scan

    def only_mapped(self, cfg: ProbeConfig) -> ProbeConfig:
        """ProbeConfig.only_mapped: `cfg` without the GPU and operator probes when the process
        maps none of their libraries now (said in the notes: a library loaded later is not probed)."""
        maps = ProcFS().maps(self.pid)
        ops = cfg.ops and bool(find_libraries(self.pid, LIBTORCH_RE, maps=maps))
        # the API probes: where a GPU driver library is mapped, or collectives can be waited for
        # (a torch.distributed rank: libtorch mapped and RANK set)
        gpu = cfg.gpu and (bool(find_libraries(self.pid, GPU_DRIVER_RE, maps=maps))
                           or (ops and self.is_rank()))
        if cfg.gpu and not gpu:
            self._note("GPU API probes: not compiled in: the process maps no libcuda/libamdhip64 "
                       "(a GPU library it loads during this profile is not probed)")
        if cfg.ops and not ops:
            self._note("operator probes: not compiled in: the process maps no libtorch_cpu.so "
                       "(loaded during this profile, it is not probed)")
        return dataclasses.replace(cfg, gpu=gpu, ops=ops)

    def is_rank(self) -> bool:
        """A torch.distributed rank (RANK in its environment), read once per scanner."""
        if self._rank is None:
            self._rank = distributed_rank(self.pid)
        return self._rank

    def scan(self, cfg: ProbeConfig, specs: list[ProbeSpec], initial: bool) -> None:
        """Probes on the files the process maps that have none yet (`initial`: the attach's
        scan, which also notes the kinds of library not found)."""
        # one read of the maps per scan, for every library pattern
        maps = ProcFS().maps(self.pid) if cfg.ops or (cfg.gpu and specs) else []
        if cfg.gpu:
            by_re: dict[str, list[ProbeSpec]] = {}
            rank = self.is_rank()    # collective probes for torch.distributed ranks only
            for s in specs:
                if s.kind != "collective" or rank:
                    by_re.setdefault(s.library, []).append(s)
            found_any = False
            for regex, lib_specs in by_re.items():
                for lib in find_libraries(self.pid, re.compile(regex), maps=maps):
                    found_any = found_any or bool(GPU_DRIVER_RE.search(lib.path))
                    if ("api", lib.key) not in self._attached_files:
                        self._gpu_library(lib, lib_specs)
            if initial and not found_any:
                self._note("GPU API probes: not applicable: the process maps no libcuda/"
                           "libamdhip64 (CPU sampling and operator probes still apply; "
                           "libraries loaded later are picked up by rescan)")
        if cfg.ops:
            libs = find_libraries(self.pid, LIBTORCH_RE, maps=maps)
            for lib in libs:
                if ("ops", lib.key) not in self._attached_files:
                    self._torch(lib, cfg)
                    if cfg.autograd:
                        self._autograd(lib, maps)
            if initial and not libs:
                self._note("operator probes: not applicable: the process maps no libtorch_cpu.so")

    def _gpu_library(self, lib: LibraryFile, specs: list[ProbeSpec]) -> None:
        self._attached_files.add(("api", lib.key))
        # every exported version of each probed call (cuCtxSynchronize_v2, …_ptsz): spec.py
        res = resolve_library(lib.host_path, specs)
        present, missing = res.sites, res.missing
        role = next((r for k, r in _ROLE.items() if k in os.path.basename(lib.path)), "gpu")
        if not present:
            what = "collective probes" if role == "c10d" else "GPU API probes"
            self._note(f"{what}: not applicable: {lib.path} exports none of the "
                       f"{len(specs)} probed symbols")
            self.libraries.append(LibraryAttach(lib.path, role, 0, missing))
            return
        self.placer.api(lib.host_path, present)
        if missing:
            self._note(f"{lib.path}: {len(missing)} probed symbols not exported "
                       f"({', '.join(missing[:6])}{'…' if len(missing) > 6 else ''})")
        if res.summary():
            self._note(f"{lib.path}: probes on exported versions: {res.summary()}")
        self.libraries.append(LibraryAttach(lib.path, role, len(present), missing,
                                            tuple((p.spec.symbol, p.export) for p in present)))

    def _torch(self, lib: LibraryFile, cfg: ProbeConfig) -> None:
        self._attached_files.add(("ops", lib.key))
        ops: list[OpSymbol] = select_ops(find_op_symbols(lib.host_path), cfg.op_filter, cfg.all_ops)
        fallback = self.placer.fallback
        if fallback:
            wanted = {n: i for i, n in enumerate(FALLBACK_OPS)}
            ops = [o for o in ops if o.name in wanted]
        if not ops:
            self._note(f"operator probes: not applicable: {lib.path} exports no at::_ops::*::call")
            self.libraries.append(LibraryAttach(lib.path, "torch", 0))
            return
        if fallback:    # one stub per op of FALLBACK_OPS: the op index is the stub's
            self.op_names[:] = FALLBACK_OPS
            indices = [wanted[o.name] for o in ops]
        else:
            base = len(self.op_names)
            self.op_names.extend(o.name for o in ops)
            indices = list(range(base, base + len(ops)))
        self.placer.ops(lib.host_path, [o.offset for o in ops], indices)
        self.libraries.append(LibraryAttach(lib.path, "torch", len(ops)))

    def _autograd(self, lib: LibraryFile, maps) -> None:
        """The forward→backward link's two entry points in libtorch_cpu (autograd.bpf.c), and
        the node classes' vtables of that file."""
        from stacklens.introspect.elf import ElfFile, symbol_offsets

        offsets = symbol_offsets(lib.host_path, tuple(autograd.SYMBOLS))
        with ElfFile(lib.host_path) as elf:
            mine = [m for m in maps if m.inode == lib.inode and m.dev == lib.dev]
            bias = elf.load_bias(mine) if mine else None
        missing = [s for s in autograd.SYMBOLS if s not in offsets]
        if missing or bias is None:
            self._note(f"backward link: unavailable: {lib.path} does not export "
                       f"{'the autograd entry points' if missing else 'a mapping we can place'} "
                       "(backward work keeps the stacks of the autograd threads)")
            return
        self.vtables.add(lib.host_path, bias)
        self._add_node_classes(maps)
        self.placer.autograd(lib.host_path, offsets)
        self._note("backward link: on (autograd nodes created and evaluated are probed)")

    def _add_node_classes(self, maps) -> None:
        """Node classes defined outside libtorch_cpu: PyNode (custom autograd.Function,
        checkpoint) in libtorch_python, CUDA-only nodes in libtorch_cuda."""
        from stacklens.introspect.elf import ElfFile

        for lib in find_libraries(self.pid, _NODE_LIBS_RE, maps=maps):
            mine = [m for m in maps if m.inode == lib.inode and m.dev == lib.dev]
            try:
                with ElfFile(lib.host_path) as elf:
                    bias = elf.load_bias(mine)
                self.vtables.add(lib.host_path, bias, symtab=True)
            except (StacklensError, OSError):
                continue   # its nodes keep their vtable address as the name


def distributed_rank(pid: int) -> bool:
    """Whether `pid` is a torch.distributed rank by its environment (RANK, as torchrun sets it:
    introspect/ranks.py reads the same)."""
    return bool(ProcFS().environ_has(pid, "RANK"))
