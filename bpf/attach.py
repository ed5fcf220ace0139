"""ProbeAttacher: the stacklens BPF program compiled (or taken from POOL) for one process and its
probes attached: uprobes on the GPU API and libtorch (uprobe_multi links, per-probe perf-event
uprobes otherwise), the CPU sampler's target entry, rescans for libraries loaded later, detach.

Requires root (CAP_BPF + CAP_PERFMON + CAP_SYS_PTRACE for /proc/PID/root), kernel >= 6.6 for
uprobe_multi (per-probe perf-event uprobes otherwise, with a short op list). A compile is 2-4 s
of CPU (one per program key, bpf/shared.py); an attach of a compiled program ~50 ms plus ~1 ms
per library; a rescan reads /proc/PID/maps once.
"""

from __future__ import annotations

import ctypes as ct
import dataclasses
import errno
import os
import re
import time
from dataclasses import dataclass, field
from typing import Callable

from stacklens.errors import (AttachError, InputError, NoSuchProcess, NotApplicable, PermissionDenied,
                              StacklensError, UnsupportedVersion)
from stacklens.introspect.procfs import ProcFS, check_pid

from stacklens.bpf import autograd, program
from stacklens.bpf.decode import PY_MAX_DEPTH
from stacklens.bpf.shared import POOL, SharedProgram
from stacklens.bpf.report import LibraryAttach
from stacklens.bpf.events_abi import SlSpec
from stacklens.bpf.ops import LIBTORCH_RE, OpSymbol, find_op_symbols, select_ops
from stacklens.bpf.procmaps import LibraryFile, find_libraries
from stacklens.bpf.spec import DEFAULT_SPEC, ProbeSpec, load_specs, resolve_library
from stacklens.bpf.uprobe_multi import BPF_TRACE_UPROBE_MULTI, UprobeMultiError, attach_uprobe_multi

_NODE_LIBS_RE = re.compile(r"^libtorch_(python|cuda|hip)\.so")
_ROLE = {"libcuda": "cuda", "libamdhip64": "hip", "libtorch_cpu": "c10d"}
GPU_DRIVER_RE = re.compile(r"libcuda\.so|libamdhip64\.so")
# ops attached when uprobe_multi is unavailable (one perf event each: slow to attach and detach)
FALLBACK_OPS = ("aten::linear", "aten::addmm", "aten::matmul", "aten::mm", "aten::bmm", "aten::conv2d",
                "aten::convolution", "aten::relu", "aten::softmax_int", "aten::layer_norm",
                "aten::embedding", "aten::add_Tensor", "aten::mul_Tensor", "aten::copy_",
                "aten::to_dtype", "aten::t", "aten::mse_loss", "aten::sum", "aten::item")
# (aten::t is a VIEW_OPS op: select_ops leaves it out unless all_ops / an op_filter asks for it)


@dataclass(frozen=True)
class ProbeConfig:
    cpu_sample_hz: int = 99
    ops: bool = True
    gpu: bool = True
    native_stacks: bool = True
    python_stacks: bool = True
    spec_path: str = str(DEFAULT_SPEC)
    ringbuf_pages: int = 4096          # 16 MiB
    rescan_interval_s: float = 2.0     # look for libraries loaded after attach (0 = never)
    # Op selection (bpf/ops.py select_ops): by default every at::_ops::*::call except the view
    # and metadata ops of ops.VIEW_OPS; all_ops=True probes those too (also env STACKLENS_ALL_OPS=1,
    # for the CLI and the daemon); op_filter, a regex searched in op names, picks from every op.
    op_filter: str = ""
    all_ops: bool = field(default_factory=lambda: os.environ.get("STACKLENS_ALL_OPS", "") not in ("", "0"))
    force_fallback: bool = False       # per-probe perf-event uprobes even where uprobe_multi works
    # the forward→backward link (autograd.bpf.c, with the op probes); env STACKLENS_AUTOGRAD=0: off
    autograd: bool = field(default_factory=lambda: os.environ.get("STACKLENS_AUTOGRAD", "1") not in ("0", "no", "off"))
    # extra -D flags for pystack.h (e.g. -DSL_PY_STACKS=…), added after the ones attach() gets
    # from PythonStackReader for this target (layout, TLS offset, interpreter address)
    pystack_cflags: tuple[str, ...] = ()
    extra_cflags: tuple[str, ...] = ()  # more -D parameters (e.g. -DSL_BENCH_FANOUT=8 in benchmarks)
    # CPU samples also carry their registers and up to 16 KiB of stack, walked in user space with
    # the libraries' .eh_frame where frame pointers end (bpf/unwind.py): whole native stacks
    # through MKL/libpython (99.7-100% unbroken under ops on a torch loop) for 33-59 µs of CPU per
    # sample walked offline, 160 µs live on a loaded VM, less than symbolizing the frame-pointer
    # walk's garbage costs (docs/benchmarks/native-stacks.md). Opt-in (env STACKLENS_NATIVE_UNWIND=cfi,
    # for the CLI and the daemon) until the GPU safety matrix has run with it whole (docs/decisions.md)
    cfi_unwind: bool = field(default_factory=lambda: os.environ.get("STACKLENS_NATIVE_UNWIND", "") == "cfi")
    # compile only the parts the process can use now: GPU probes when it maps a GPU driver library,
    # operator probes when it maps libtorch_cpu (a pure-Python target: 5.9 s of BCC compile instead
    # of 10 s on the 2-vCPU machine). For one-shot profiles; a daemon keeps one program for all.
    only_mapped: bool = False


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


class BpfMaps:
    """The decoder's view of a loaded program's maps (bpf/decode.py DecodeMaps)."""

    def __init__(self, bpf, python_stacks: bool):
        self._bpf = bpf
        self._py_table = bpf[b"sl_py_stacks"] if python_stacks else None

    def walk_stack(self, table: bytes, key: int):
        return self._bpf[table].walk(key)

    def op_path(self, h: int) -> tuple[int, ...]:
        table = self._bpf[b"op_paths"]
        p = table[table.Key(h)]
        return tuple(p.ops[:p.depth])

    def py_stack(self, pyid: int) -> bytes:
        table = self._py_table
        return bytes(table[table.Key(pyid)])


class ProbeAttacher:
    """The probes of one process: attach() -> rescan()* -> detach(); detach is idempotent.
    `phase` is told each step of an attach ("compiling BPF", …)."""

    def __init__(self, pid: int, config: ProbeConfig, phase: Callable[[str], None] = lambda name: None):
        self.pid = pid
        self.config = config
        self._phase = phase
        self.bpf = None
        self.shared: SharedProgram | None = None   # the compiled program, shared (bpf/shared.py)
        self._key: tuple = ()
        self.slot = -1             # this process's counter slot in it
        self.links: list[int] = []
        # (what was attached: "api" or "ops", the library's key): libtorch_cpu gets both
        self._attached_files: set[tuple[str, tuple[str, int]]] = set()
        self._rank: bool | None = None   # a torch.distributed rank (RANK set): read at the first scan
        self.specs: list[ProbeSpec] = []
        self._op_own: dict[int, bool] = {}   # op-path hash -> it is this process's (shared maps)
        self.compiled = False      # the last _compile_and_load compiled (not found in POOL)
        self.op_names: list[str] = []        # op index -> name (the decoder reads the same list)
        self.vtables = autograd.VtableNames()   # autograd node classes by vtable pointer
        self.py = None             # PythonStackReader when Python stacks are captured
        self.fallback = False
        self.last_scan = 0.0
        self.counts = {"rescans": 0, "py_unsupported": 0}
        self.libraries: list[LibraryAttach] = []
        self.notes: list[str] = []
        self.source: program.ProgramSource | None = None

    def attach(self) -> None:
        """Compiles (or takes from POOL) the program, attaches the probes and makes the program
        serve this process; on any failure nothing stays attached and the error says why."""
        check_pid(self.pid)
        self.notes = []
        self.libraries = []
        if self.config.only_mapped:
            self._drop_unmapped()
        cfg = self.config
        self.specs = load_specs(cfg.spec_path) if cfg.gpu else []
        for s in self.specs:
            s.decoder()               # compiled now, not at its first event
        try:
            self._phase("reading the target")
            self._compile_and_load()
            self._phase("attaching probes")
            self._scan(initial=True)
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
        if self.config.force_fallback or not _uprobe_multi_supported():
            return False              # per-probe programs are never shared: nothing to prepare
        self.specs = load_specs(self.config.spec_path) if self.config.gpu else []
        try:
            self._compile_and_load()
            return self.compiled
        finally:
            # the program goes back to POOL; nothing of this process was added to it
            shared, self.shared, self.bpf = self.shared, None, None
            if shared is not None:
                POOL.release(self._key, shared)
            py, self.py = self.py, None
            if py is not None:
                py.mem.close()

    def _compile_and_load(self) -> None:
        """The program this process needs: reused from POOL when one with the same settings is
        compiled already (bpf/shared.py), else compiled (one BCC compile at a time per process)."""
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
        self.fallback = cfg.force_fallback or not _uprobe_multi_supported()
        if self.fallback:
            self.notes.append("uprobe_multi unavailable: per-probe uprobes with a short op list "
                              f"({len(FALLBACK_OPS)} ops); detach takes ~0.1 s per probe")
        src = program.build_source(
            gpu=cfg.gpu, ops=cfg.ops, cpu=cfg.cpu_sample_hz > 0, native_stacks=cfg.native_stacks,
            python_stacks=bool(py_flags), pystack_cflags=py_flags, max_specs=max(64, len(self.specs)), ringbuf_pages=cfg.ringbuf_pages,
            api_stubs=len(self.specs) if self.fallback else 0,
            op_stubs=len(FALLBACK_OPS) if self.fallback else 0, autograd=cfg.ops and cfg.autograd)
        extra = tuple(cfg.extra_cflags) + (() if cfg.cfi_unwind else ("-DSL_STACK_COPY=0",))
        if extra:
            src = program.ProgramSource(src.text, src.cflags + extra)
        self.source = src
        # per-probe uprobes (the fallback) belong to the module they were attached through: not shared
        self._key = (src.text, src.cflags, tuple(bytes(s.bpf_spec()) for s in self.specs),
                     cfg.cpu_sample_hz, cfg.ringbuf_pages, id(self) if self.fallback else 0)
        compiled = []

        def build() -> SharedProgram:
            self._phase("compiling BPF")
            compiled.append(True)
            try:
                return SharedProgram(src, setup=self._setup_program, cpu_sample_hz=cfg.cpu_sample_hz,
                                     ringbuf_pages=cfg.ringbuf_pages)
            except Exception as e:
                raise AttachError(f"BPF compile failed: {e}; check kernel headers with `stacklens doctor`") from e

        self.shared = POOL.acquire(self._key, build)
        self.compiled = bool(compiled)
        if not compiled:
            self.notes.append(f"BPF program: compiled before, shared with {self.shared.users - 1} other "
                              "attached process(es) or kept from an earlier attach")
        self.bpf = self.shared.bpf
        loaded = self.shared.loaded
        self._api_entry, self._api_return = loaded.get("api_entry"), loaded.get("api_return")
        self._op_entry, self._ag_entry = loaded.get("op_entry"), loaded.get("autograd")

    def _setup_program(self, bpf) -> dict:
        """Once per compiled program: the probe specs and the uprobe_multi programs loaded."""
        from bcc import BPF  # imported here: no import-time side effects, tests without bcc still import

        cfg = self.config
        if cfg.gpu:
            table = bpf.get_table(b"specs", keytype=ct.c_int, leaftype=SlSpec)
            for s in self.specs:
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


    def rescan(self) -> list[LibraryAttach]:
        """Attach to libraries the process mapped since the last scan; returns what was added."""
        before = len(self.libraries)
        if self.py is not None and self.py.mode == "map":
            self.py.refresh_threads()  # threads started since: tid -> tstate
        self._scan(initial=False)
        self.counts["rescans"] += 1
        self.last_scan = time.monotonic()
        return self.libraries[before:]

    def _drop_unmapped(self) -> None:
        """ProbeConfig.only_mapped: GPU and operator probes out of the program when the process
        maps none of their libraries now (said in the notes: a library loaded later is not probed)."""
        cfg = self.config
        maps = ProcFS().maps(self.pid)
        ops = cfg.ops and bool(find_libraries(self.pid, LIBTORCH_RE, maps=maps))
        # the API probes: where a GPU driver library is mapped, or collectives can be waited for
        # (a torch.distributed rank: libtorch mapped and RANK set)
        gpu = cfg.gpu and (bool(find_libraries(self.pid, GPU_DRIVER_RE, maps=maps))
                           or (ops and self._is_rank()))
        if cfg.gpu and not gpu:
            self.notes.append("GPU API probes: not compiled in: the process maps no libcuda/libamdhip64 "
                              "(a GPU library it loads during this profile is not probed)")
        if cfg.ops and not ops:
            self.notes.append("operator probes: not compiled in: the process maps no libtorch_cpu.so "
                              "(loaded during this profile, it is not probed)")
        self.config = dataclasses.replace(cfg, gpu=gpu, ops=ops)

    def _is_rank(self) -> bool:
        """A torch.distributed rank (RANK in its environment), read once per attacher."""
        if self._rank is None:
            self._rank = _distributed_rank(self.pid)
        return self._rank

    def _scan(self, initial: bool) -> None:
        cfg = self.config
        # one read of the maps per scan, for every library pattern
        maps = ProcFS().maps(self.pid) if cfg.ops or (cfg.gpu and self.specs) else []
        if cfg.gpu:
            by_re: dict[str, list[ProbeSpec]] = {}
            rank = self._is_rank()    # collective probes for torch.distributed ranks only
            for s in self.specs:
                if s.kind != "collective" or rank:
                    by_re.setdefault(s.library, []).append(s)
            found_any = False
            for regex, specs in by_re.items():
                for lib in find_libraries(self.pid, re.compile(regex), maps=maps):
                    found_any = found_any or bool(GPU_DRIVER_RE.search(lib.path))
                    if ("api", lib.key) not in self._attached_files:
                        self._attach_gpu_library(lib, specs)
            if initial and not found_any:
                self.notes.append("GPU API probes: not applicable: the process maps no libcuda/"
                                  "libamdhip64 (CPU sampling and operator probes still apply; "
                                  "libraries loaded later are picked up by rescan)")
        if cfg.ops:
            libs = find_libraries(self.pid, LIBTORCH_RE, maps=maps)
            for lib in libs:
                if ("ops", lib.key) not in self._attached_files:
                    self._attach_torch(lib)
                    if cfg.autograd:
                        self._attach_autograd(lib, maps)
            if initial and not libs:
                self.notes.append("operator probes: not applicable: the process maps no libtorch_cpu.so")

    def _attach_gpu_library(self, lib: LibraryFile, specs: list[ProbeSpec]) -> None:
        self._attached_files.add(("api", lib.key))
        # every exported version of each probed call (cuCtxSynchronize_v2, …_ptsz): spec.py
        res = resolve_library(lib.host_path, specs)
        present, missing = res.sites, res.missing
        role = next((r for k, r in _ROLE.items() if k in os.path.basename(lib.path)), "gpu")
        if not present:
            what = "collective probes" if role == "c10d" else "GPU API probes"
            self.notes.append(f"{what}: not applicable: {lib.path} exports none of the "
                              f"{len(specs)} probed symbols")
            self.libraries.append(LibraryAttach(lib.path, role, 0, missing))
            return
        if self.fallback:
            for p in present:
                self.bpf.attach_uprobe(name=lib.host_path.encode(), sym=p.export.encode(),
                                       fn_name=f"sl_api_entry_{p.spec.index}".encode(), pid=self.pid)
                if p.spec.ret:
                    self.bpf.attach_uretprobe(name=lib.host_path.encode(), sym=p.export.encode(),
                                              fn_name=f"sl_api_return_{p.spec.index}".encode(), pid=self.pid)
        else:
            self.links.append(self._link(self._api_entry.fd, lib.host_path,
                                         [p.offset for p in present], [p.spec.index for p in present]))
            rets = [p for p in present if p.spec.ret]
            if rets:
                self.links.append(self._link(self._api_return.fd, lib.host_path,
                                             [p.offset for p in rets], [p.spec.index for p in rets],
                                             retprobe=True))
        if missing:
            self.notes.append(f"{lib.path}: {len(missing)} probed symbols not exported "
                              f"({', '.join(missing[:6])}{'…' if len(missing) > 6 else ''})")
        if res.summary():
            self.notes.append(f"{lib.path}: probes on exported versions: {res.summary()}")
        self.libraries.append(LibraryAttach(lib.path, role, len(present), missing,
                                            tuple((p.spec.symbol, p.export) for p in present)))

    def _attach_torch(self, lib: LibraryFile) -> None:
        self._attached_files.add(("ops", lib.key))
        ops: list[OpSymbol] = select_ops(find_op_symbols(lib.host_path), self.config.op_filter,
                                         self.config.all_ops)
        if self.fallback:
            wanted = {n: i for i, n in enumerate(FALLBACK_OPS)}
            ops = [o for o in ops if o.name in wanted]
        if not ops:
            self.notes.append(f"operator probes: not applicable: {lib.path} exports no at::_ops::*::call")
            self.libraries.append(LibraryAttach(lib.path, "torch", 0))
            return
        if self.fallback:
            from stacklens.introspect.elf import ElfFile

            self.op_names[:] = FALLBACK_OPS
            with ElfFile(lib.host_path) as elf:  # BCC takes a virtual address and converts it
                for o in ops:
                    self.bpf.attach_uprobe(name=lib.host_path.encode(), addr=elf.offset_to_vaddr(o.offset),
                                           fn_name=f"sl_op_entry_{wanted[o.name]}".encode(), pid=self.pid)
        else:
            base = len(self.op_names)
            self.op_names.extend(o.name for o in ops)
            self.links.append(self._link(self._op_entry.fd, lib.host_path, [o.offset for o in ops],
                                         list(range(base, base + len(ops)))))
        self.libraries.append(LibraryAttach(lib.path, "torch", len(ops)))

    def _attach_autograd(self, lib: LibraryFile, maps) -> None:
        """The forward→backward link's two entry points in libtorch_cpu (autograd.bpf.c), and
        the node classes' vtables of that file."""
        from stacklens.introspect.elf import ElfFile, symbol_offsets

        offsets = symbol_offsets(lib.host_path, tuple(autograd.SYMBOLS))
        with ElfFile(lib.host_path) as elf:
            mine = [m for m in maps if m.inode == lib.inode and m.dev == lib.dev]
            bias = elf.load_bias(mine) if mine else None
        missing = [s for s in autograd.SYMBOLS if s not in offsets]
        if missing or bias is None:
            self.notes.append(f"backward link: unavailable: {lib.path} does not export "
                              f"{'the autograd entry points' if missing else 'a mapping we can place'} "
                              "(backward work keeps the stacks of the autograd threads)")
            return
        self.vtables.add(lib.host_path, bias)
        self._add_node_classes(maps)
        if self.fallback:
            for i, sym in enumerate(autograd.SYMBOLS):
                self.bpf.attach_uprobe(name=lib.host_path.encode(), sym=sym.encode(),
                                       fn_name=f"sl_autograd_{i}".encode(), pid=self.pid)
        else:
            self.links.append(self._link(self._ag_entry.fd, lib.host_path,
                                         [offsets[s] for s in autograd.SYMBOLS], [0, 1]))
        self.notes.append("backward link: on (autograd nodes created and evaluated are probed)")

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

    def _link(self, prog_fd: int, path: str, offsets: list[int], cookies: list[int],
              retprobe: bool = False) -> int:
        try:
            return attach_uprobe_multi(prog_fd, path, offsets, cookies, pid=self.pid, retprobe=retprobe)
        except UprobeMultiError as e:
            if e.errno == errno.ESRCH:
                raise NoSuchProcess(f"process {self.pid} exited during attach; nothing was left attached") from e
            if e.errno == errno.ENOENT:
                raise NoSuchProcess(f"{path} vanished during attach (process {self.pid} exited?)") from e
            raise AttachError(f"{e}; is the kernel >= 6.6 (uprobe_multi)? "
                              f"ProbeConfig(force_fallback=True) uses per-probe uprobes") from e


    # ------------------------------------------------------------------ what the program holds
    def op_hash_counts(self) -> list[tuple[int, int]]:
        """(path hash, calls) of this process's paths: the mmapped op_slots array, then the
        op_counts overflow map (both the shared program's: paths are told apart by owner)."""
        slots = self.shared.op_slots_view()
        hashes, counts = slots[0::2], slots[1::2]
        out = [(h, n) for h, n in zip(hashes, counts) if h and n]
        out += [(k.value, v.value) for k, v in self.bpf[b"op_counts"].items()]
        return [(h, n) for h, n in out if self._own_path(h)]

    def _own_path(self, h: int) -> bool:
        own = self._op_own.get(h)
        if own is None:
            table = self.bpf[b"op_paths"]
            try:
                own = table[table.Key(h)].tgid == self.pid
            except KeyError:
                return False          # not named yet (or the map was full): asked again later
            self._op_own[h] = own
        return own

    def pending_records(self) -> list[bytes] | None:
        """The raw entry events of this process's return-probed calls not yet returned (the
        shared program's `pending` map); None when it cannot be read."""
        records = []
        try:
            for _key, val in self.bpf["pending"].items():
                if val.pid == self.pid:       # the pending map is the shared program's
                    records.append(ct.string_at(ct.addressof(val), ct.sizeof(val)))
        except (KeyError, OSError):
            return None
        return records

    # ------------------------------------------------------------------ detach
    def detach(self) -> None:
        """Remove every probe; safe to call twice and after a failed attach. The compiled
        program goes back to POOL for the next attach."""
        links, self.links = self.links, []
        for fd in links:
            try:
                os.close(fd)
            except OSError:
                pass
        shared, self.shared = self.shared, None
        if shared is not None:
            try:
                shared.remove_target(self.pid, self.slot)
                if self.py is not None:
                    self.py.forget_threads(shared.bpf)
            except Exception:  # noqa: BLE001 — an unusable program is not reused
                POOL.discard(self._key, shared)
            else:
                if self.fallback:    # its per-probe uprobes go with the module (bpf.cleanup)
                    POOL.discard(self._key, shared)
                else:
                    POOL.release(self._key, shared)
        self.bpf = None
        self.slot = -1
        py, self.py = self.py, None
        if py is not None:
            try:
                py.mem.close()
            except Exception:
                pass


_UPROBE_MULTI: bool | None = None


def _distributed_rank(pid: int) -> bool:
    """Whether `pid` is a torch.distributed rank by its environment (RANK, as torchrun sets it:
    introspect/ranks.py reads the same)."""
    return bool(ProcFS().environ_has(pid, "RANK"))


def _uprobe_multi_supported() -> bool:
    """Kernel >= 6.6 with CONFIG_UPROBES: checked once via the kernel version."""
    global _UPROBE_MULTI
    if _UPROBE_MULTI is None:
        m = re.match(r"(\d+)\.(\d+)", os.uname().release)
        _UPROBE_MULTI = bool(m) and (int(m.group(1)), int(m.group(2))) >= (6, 6)
    return _UPROBE_MULTI
