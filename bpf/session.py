"""ProbeSession: attach the stacklens BPF programs to one running process by PID.

Requires root (CAP_BPF + CAP_PERFMON + CAP_SYS_PTRACE for /proc/PID/root), kernel >= 6.6 for
uprobe_multi (per-probe perf-event uprobes otherwise, with a short op list).
Overhead (measured on the 2-core Firecracker VM, docs/benchmarks/probes.md): one uprobe hit per
GPU API call and per libtorch op call (~3 µs each here), 99 Hz per CPU for samples.
"""

from __future__ import annotations

import ctypes as ct
import errno
import gc
import logging
import os
import re
import struct
import time
from dataclasses import dataclass, field

from stacklens.errors import (AttachError, InputError, NoSuchProcess, NotApplicable, PermissionDenied,
                              StacklensError, UnsupportedVersion)
from stacklens.cct import Frame
from stacklens.introspect.procfs import ProcFS, check_pid

from stacklens.bpf import autograd, program
from stacklens.bpf.shared import POOL, SharedProgram
from stacklens.records.events import Event, make_event
from stacklens.bpf.report import AttachReport, LibraryAttach
from stacklens.bpf.events_abi import (COUNTERS, SL_BLOB, SL_EV_NAME, SL_EV_NODE_NEW, SL_EV_SAMPLE, SL_NAME, SL_NARGS,
                         SL_STACK_IN_2, SL_STACK_INLINE, SlEvent, SlSpec)
from stacklens.bpf.ops import LIBTORCH_RE, OpSymbol, find_op_symbols, select_ops
from stacklens.bpf.procmaps import UNKNOWN as UNKNOWN_FRAME
from stacklens.bpf.procmaps import LibraryFile, Symbolizer, collapse_unsymbolized, find_libraries
from stacklens.bpf.ringbuf import BUSY, DISCARD, RingBufReader
from stacklens.bpf.spec import DEFAULT_SPEC, MEMCPY_KINDS, ProbeSpec, load_specs, resolve_library
from stacklens.bpf.uprobe_multi import BPF_TRACE_UPROBE_MULTI, UprobeMultiError, attach_uprobe_multi

log = logging.getLogger(__name__)
_HEAD = struct.Struct("<IIIIQQQIiQQQQQ")  # sl_event up to `args` (checked against SlEvent below)
_ARGS = struct.Struct(f"<{SL_NARGS}Q")
_ARGS_OFF = SlEvent.args.offset
_BLOB_OFF = SlEvent.blob.offset
assert _HEAD.size == _ARGS_OFF and _ARGS_OFF + _ARGS.size == _BLOB_OFF
_NAME_HEAD = struct.Struct("<IIIIQQ")
# ring record header (length | BUSY | DISCARD, page offset) + the sl_event head: one unpack per record
_REC = struct.Struct("<II" + _HEAD.format[1:])
_ARGS_REC = 8 + _ARGS_OFF
_BLOB_REC = 8 + _BLOB_OFF
COMMIT_BYTES = 1 << 20  # consumer position handed back to the producers at least this often
_EVENT_SIZE = ct.sizeof(SlEvent)
_RING_HDR = struct.Struct("<II")
_tuple_new = tuple.__new__  # Event is a tuple subclass (bpf/events.py)
_NO_ARGS: dict = {}  # shared by every sample (Event.args is read-only by contract)
_KIND = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_NODE_LIBS_RE = re.compile(r"^libtorch_(python|cuda|hip)\.so")
TRUNCATED = Frame.other("[truncated]")
STACK_DEPTH = 127  # frames a BPF stack-map walk holds (perf_event_max_stack): a full walk may be cut
INLINE_CACHE_MAX = 4096  # CPU samples' stacks kept by their addresses (≤ ~5 MiB; then it starts again)
TRUNCATED_STACK = (TRUNCATED,)
PY_LOST = (Frame.other("[python stack lost]"),)  # id evicted from the LRU map before we read it
PY_UNDECODABLE = (Frame.other("[python stack undecodable]"),)  # the symbolizer raised: a bug, counted
UNDECODABLE_KEEP = 4  # distinct "what raised" texts kept for the notes (the first ones)
PY_MAX_DEPTH = 48
PY_CACHE_MAX = 65536  # symbolized Python stacks kept by id (ids are content hashes: reusable)
# outermost frames of a complete user stack; anything else at the bottom means the unwind was cut
_STACK_ROOTS = ("_start", "__libc_start_main", "__libc_start_call_main", "clone", "clone3",
                "__clone", "__clone3", "start_thread", "__GI___clone3", "__GI___clone")
_ROLE = {"libcuda": "cuda", "libamdhip64": "hip"}
# ops attached when uprobe_multi is unavailable (one perf event each: slow to attach and detach)
FALLBACK_OPS = ("aten::linear", "aten::addmm", "aten::matmul", "aten::mm", "aten::bmm", "aten::conv2d",
                "aten::convolution", "aten::relu", "aten::softmax_int", "aten::layer_norm",
                "aten::embedding", "aten::add_Tensor", "aten::mul_Tensor", "aten::copy_",
                "aten::to_dtype", "aten::t", "aten::mse_loss", "aten::sum", "aten::item")
# (aten::t is a VIEW_OPS op: select_ops leaves it out unless all_ops / an op_filter asks for it)


def native_frames(addrs: list[int], frame, walked: int | None = None) -> tuple[tuple[Frame, ...], bool]:
    """A frame-pointer walk (innermost-first addresses, as BPF returns them) -> outermost-first
    frames, and whether the walk was cut: it ends at the first address outside every
    executable mapping (`[unknown]`: the walk read garbage there, e.g. a caller that does not keep
    frame pointers), at the map's depth limit, or anywhere but a thread's entry (_start,
    start_thread, clone): then a `[truncated]` frame leads. JIT code (`[anon]`) and the vDSO
    are real frames of the stack and do not end it. Runs of unsymbolized frames of one library
    collapse into one. `walked`: how many addresses the walk itself gave (default all of them;
    fewer when the direct caller was added to them)."""
    inner: list[Frame] = []
    cut = (len(addrs) if walked is None else walked) >= STACK_DEPTH
    for a in addrs:
        f = frame(a)
        if f == UNKNOWN_FRAME:
            cut = True
            break
        inner.append(f)
    frames = collapse_unsymbolized(reversed(inner))
    root = frames[0].name if frames else ""
    if cut or not any(root == r or root.startswith(r + "@") for r in _STACK_ROOTS):
        return (TRUNCATED,) + frames, True
    return frames, False


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


class _RecordList:
    """Records from the perf-buffer fallback laid out like the ring (8-byte header each), so
    `_decode_ring` reads them with the same code."""

    def __init__(self, records: list[bytes]):
        buf = bytearray()
        for r in records:
            buf += _RING_HDR.pack(len(r), 0) + r + bytes(-len(r) % 8)
        self.data = memoryview(buf)
        self.mask = (1 << 62) - 1
        self._end = len(buf)

    def positions(self) -> tuple[int, int]:
        return 0, self._end

    def commit(self, pos: int) -> None:
        pass


def dump_bpf(pid: int, config: ProbeConfig = ProbeConfig()) -> str:
    """The final C text (with its cflags) a session for `pid` compiles: `--dump-bpf`."""
    specs = load_specs(config.spec_path)
    py_flags: tuple[str, ...] = ()
    if config.python_stacks and program.pystack_available():
        reader, _ = python_reader(pid)
        if reader is not None:
            py_flags = tuple(reader.program_cflags()) + tuple(config.pystack_cflags)
    return program.build_source(
        gpu=config.gpu, ops=config.ops, cpu=config.cpu_sample_hz > 0,
        native_stacks=config.native_stacks, python_stacks=bool(py_flags),
        pystack_cflags=py_flags, max_specs=max(64, len(specs)), ringbuf_pages=config.ringbuf_pages).render()


def python_reader(pid: int):
    """(PythonStackReader, note) for a supported CPython target, else (None, why not)."""
    from stacklens.bpf.python_process import PythonStackReader

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


class ProbeSession:
    """Probes of one process. attach() -> poll()* -> detach(); detach is idempotent."""

    def __init__(self, pid: int, config: ProbeConfig = ProbeConfig()):
        self.pid = pid
        self.config = config
        self._bpf = None
        self._shared: SharedProgram | None = None   # the compiled program, shared (bpf/shared.py)
        self._key: tuple = ()
        self._slot = -1            # this process's counter slot in it
        self._links: list[int] = []
        self._reader: RingBufReader | None = None
        self._attached_files: set[tuple[str, int]] = set()
        self._specs: list[ProbeSpec] = []
        self._decoders: list = []
        self._shapes: dict[int, tuple] = {}
        self._op_own: dict[int, bool] = {}   # op-path hash -> it is this process's (shared maps)
        self._compiled = False     # the last _compile_and_load compiled (not found in POOL)
        self._op_names: list[str] = []
        self._vtables = autograd.VtableNames()   # autograd node classes by vtable pointer
        self._names: dict[int, str] = {}
        self._unresolved_names: dict[int, str] = {}
        self._allocs: dict[int, int] = {}
        self._stack_cache: dict[int, tuple[Frame, ...]] = {}
        self._inline_cache: dict[bytes, tuple[Frame, ...]] = {}   # CPU samples' stacks by address bytes
        self._py = None            # PythonStackReader when Python stacks are captured
        self._py_cache: dict[int, tuple[tuple[Frame, ...], tuple[bool, ...]]] = {0: ((), ())}
        self._op_cache: dict[int, tuple[str, ...]] = {0: ()}
        self._symbolizer: Symbolizer | None = None
        self._fallback = False
        self._last_scan = 0.0
        self._user = {"decoded": 0, "truncated_stacks": 0, "stack_lookup_failures": 0, "rescans": 0,
                      "py_unsupported": 0, "py_stacks_symbolized": 0, "py_stacks_lost": 0,
                      "py_stacks_undecodable": 0, "records_undecodable": 0}
        self._undecodable: dict[str, str] = {}   # "what raised" -> where (read_notes)
        self._libraries: list[LibraryAttach] = []
        self._notes: list[str] = []
        self.attached = False

    # ------------------------------------------------------------------ attach
    def attach(self) -> AttachReport:
        if self.attached:
            from stacklens.errors import AlreadyAttached
            raise AlreadyAttached(f"this session is already attached to {self.pid}; detach() first")
        t0 = time.perf_counter()
        check_pid(self.pid)
        cfg = self.config
        self._specs = load_specs(cfg.spec_path) if cfg.gpu else []
        self._decoders = [s.decoder() for s in self._specs]
        self._shapes = {}
        self._notes = []
        self._libraries = []
        try:
            self._phase("reading the target")
            self._compile_and_load()
            self._phase("attaching probes")
            self._scan(initial=True)
            if cfg.cpu_sample_hz > 0:
                self._phase("starting CPU sampling")
            interp, tls = (0, 0)
            if self._py is not None:
                interp, tls = self._py.target_params()
                self._py.populate(self._bpf)   # the tid -> tstate map (threads TLS misses)
            # from here the program serves this process (and the CPU sampler runs for it)
            self._slot = self._shared.add_target(self.pid, interp, tls)
            self._reader = self._shared.reader
            self._symbolizer = Symbolizer(self.pid)
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
        self.attached = True
        self._last_scan = time.monotonic()
        n = sum(lib.probes for lib in self._libraries)
        return AttachReport(self.pid, tuple(self._libraries), n, cfg.cpu_sample_hz,
                            time.perf_counter() - t0, tuple(self._notes),
                            "perf_event" if self._fallback else "uprobe_multi", self._py is not None)

    def prepare(self) -> bool:
        """Compiles (or finds in POOL) the program an attach to this process would use, and
        attaches nothing to it: the daemon does this ahead of the first attach, since a compile
        is most of an attach (3-9 s of a busy 2-vCPU machine). True when it compiled one."""
        check_pid(self.pid)
        if self.config.force_fallback or not _uprobe_multi_supported():
            return False              # per-probe programs are never shared: nothing to prepare
        self._specs = load_specs(self.config.spec_path) if self.config.gpu else []
        try:
            self._compile_and_load()
            return self._compiled
        finally:
            # the program goes back to POOL; nothing of this process was added to it
            shared, self._shared, self._bpf = self._shared, None, None
            if shared is not None:
                POOL.release(self._key, shared)
            py, self._py = self._py, None
            if py is not None:
                py.mem.close()

    def _compile_and_load(self) -> None:
        """The program this process needs: reused from POOL when one with the same settings is
        compiled already (bpf/shared.py), else compiled (one BCC compile at a time per process)."""
        cfg = self.config
        py_flags: tuple[str, ...] = ()
        self._py = None
        if cfg.python_stacks and program.pystack_available():
            self._py, note = python_reader(self.pid)
            self._notes.append(note)
            if self._py is None:
                self._user["py_unsupported"] += 1
            else:
                py_flags = tuple(self._py.program_cflags()) + tuple(cfg.pystack_cflags)
        self._fallback = cfg.force_fallback or not _uprobe_multi_supported()
        if self._fallback:
            self._notes.append("uprobe_multi unavailable: per-probe uprobes with a short op list "
                               f"({len(FALLBACK_OPS)} ops); detach takes ~0.1 s per probe")
        src = program.build_source(
            gpu=cfg.gpu, ops=cfg.ops, cpu=cfg.cpu_sample_hz > 0, native_stacks=cfg.native_stacks,
            python_stacks=bool(py_flags), pystack_cflags=py_flags, max_specs=max(64, len(self._specs)), ringbuf_pages=cfg.ringbuf_pages,
            api_stubs=len(self._specs) if self._fallback else 0,
            op_stubs=len(FALLBACK_OPS) if self._fallback else 0, autograd=cfg.ops and cfg.autograd)
        if cfg.extra_cflags:
            src = program.ProgramSource(src.text, src.cflags + tuple(cfg.extra_cflags))
        self._source = src
        # per-probe uprobes (the fallback) belong to the module they were attached through: not shared
        self._key = (src.text, src.cflags, tuple(bytes(s.bpf_spec()) for s in self._specs),
                     cfg.cpu_sample_hz, cfg.ringbuf_pages, id(self) if self._fallback else 0)
        compiled = []

        def build() -> SharedProgram:
            self._phase("compiling BPF")
            compiled.append(True)
            try:
                return SharedProgram(src, setup=self._setup_program, cpu_sample_hz=cfg.cpu_sample_hz,
                                     ringbuf_pages=cfg.ringbuf_pages)
            except Exception as e:
                raise AttachError(f"BPF compile failed: {e}; check kernel headers with `stacklens doctor`") from e

        self._shared = POOL.acquire(self._key, build)
        self._compiled = bool(compiled)
        if not compiled:
            self._notes.append(f"BPF program: compiled before, shared with {self._shared.users - 1} other "
                               "attached process(es) or kept from an earlier attach")
        self._bpf = self._shared.bpf
        loaded = self._shared.loaded
        self._api_entry, self._api_return = loaded.get("api_entry"), loaded.get("api_return")
        self._op_entry, self._ag_entry = loaded.get("op_entry"), loaded.get("autograd")
        if self._py is not None:
            self._py_table = self._bpf[b"sl_py_stacks"]

    def _setup_program(self, bpf) -> dict:
        """Once per compiled program: the probe specs and the uprobe_multi programs loaded."""
        from bcc import BPF  # imported here: no import-time side effects, tests without bcc still import

        cfg = self.config
        if cfg.gpu:
            table = bpf.get_table(b"specs", keytype=ct.c_int, leaftype=SlSpec)
            for s in self._specs:
                table[table.Key(s.index)] = s.bpf_spec()
        loaded = {}
        if not self._fallback:
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

    def preload_symbols(self) -> int:
        """Read the symbol table of every file the process maps executable now rather than at
        its first sample (`record`, while the program is held): the first samples then decode at
        once, before a program that is starting up frees the code objects of the modules it was
        importing. Returns how many files were read."""
        sym = self._symbolizer
        if sym is None:
            return 0
        seen = set()
        for m in ProcFS().maps(self.pid):
            if "x" in m.perms and m.path.startswith("/") and m.path not in seen:
                seen.add(m.path)
                sym.frame(m.start)
        return len(seen)

    # progress of attach(): called with a phase name ("compiling BPF", …); None: silent
    on_phase = None

    def _phase(self, name: str) -> None:
        if self.on_phase is not None:
            self.on_phase(name)

    # ------------------------------------------------------------------ discovery
    def rescan(self) -> list[LibraryAttach]:
        """Attach to libraries the process mapped since the last scan; returns what was added."""
        before = len(self._libraries)
        if self._py is not None and self._py.mode == "map":
            self._py.refresh_threads()  # threads started since: tid -> tstate
        self._scan(initial=False)
        self._user["rescans"] += 1
        self._last_scan = time.monotonic()
        return self._libraries[before:]

    def _scan(self, initial: bool) -> None:
        cfg = self.config
        # one read of the maps per scan, for every library pattern
        maps = ProcFS().maps(self.pid) if cfg.ops or (cfg.gpu and self._specs) else []
        if cfg.gpu:
            by_re: dict[str, list[ProbeSpec]] = {}
            for s in self._specs:
                by_re.setdefault(s.library, []).append(s)
            found_any = False
            for regex, specs in by_re.items():
                for lib in find_libraries(self.pid, re.compile(regex), maps=maps):
                    found_any = True
                    if lib.key not in self._attached_files:
                        self._attach_gpu_library(lib, specs)
            if initial and not found_any:
                self._notes.append("GPU API probes: not applicable: the process maps no libcuda/"
                                   "libamdhip64 (CPU sampling and operator probes still apply; "
                                   "libraries loaded later are picked up by rescan)")
        if cfg.ops:
            libs = find_libraries(self.pid, LIBTORCH_RE, maps=maps)
            for lib in libs:
                if lib.key not in self._attached_files:
                    self._attach_torch(lib)
                    if cfg.autograd:
                        self._attach_autograd(lib, maps)
            if initial and not libs:
                self._notes.append("operator probes: not applicable: the process maps no libtorch_cpu.so")

    def _attach_gpu_library(self, lib: LibraryFile, specs: list[ProbeSpec]) -> None:
        self._attached_files.add(lib.key)
        # every exported version of each probed call (cuCtxSynchronize_v2, …_ptsz): spec.py
        res = resolve_library(lib.host_path, specs)
        present, missing = res.sites, res.missing
        role = next((r for k, r in _ROLE.items() if k in os.path.basename(lib.path)), "gpu")
        if not present:
            self._notes.append(f"GPU API probes: not applicable: {lib.path} exports none of the "
                               f"{len(specs)} probed symbols")
            self._libraries.append(LibraryAttach(lib.path, role, 0, missing))
            return
        if self._fallback:
            for p in present:
                self._bpf.attach_uprobe(name=lib.host_path.encode(), sym=p.export.encode(),
                                        fn_name=f"sl_api_entry_{p.spec.index}".encode(), pid=self.pid)
                if p.spec.ret:
                    self._bpf.attach_uretprobe(name=lib.host_path.encode(), sym=p.export.encode(),
                                               fn_name=f"sl_api_return_{p.spec.index}".encode(), pid=self.pid)
        else:
            self._links.append(self._link(self._api_entry.fd, lib.host_path,
                                          [p.offset for p in present], [p.spec.index for p in present]))
            rets = [p for p in present if p.spec.ret]
            if rets:
                self._links.append(self._link(self._api_return.fd, lib.host_path,
                                              [p.offset for p in rets], [p.spec.index for p in rets],
                                              retprobe=True))
        if missing:
            self._notes.append(f"{lib.path}: {len(missing)} probed symbols not exported "
                               f"({', '.join(missing[:6])}{'…' if len(missing) > 6 else ''})")
        if res.summary():
            self._notes.append(f"{lib.path}: probes on exported versions: {res.summary()}")
        self._libraries.append(LibraryAttach(lib.path, role, len(present), missing,
                                             tuple((p.spec.symbol, p.export) for p in present)))

    def _attach_torch(self, lib: LibraryFile) -> None:
        self._attached_files.add(lib.key)
        ops: list[OpSymbol] = select_ops(find_op_symbols(lib.host_path), self.config.op_filter,
                                         self.config.all_ops)
        if self._fallback:
            wanted = {n: i for i, n in enumerate(FALLBACK_OPS)}
            ops = [o for o in ops if o.name in wanted]
        if not ops:
            self._notes.append(f"operator probes: not applicable: {lib.path} exports no at::_ops::*::call")
            self._libraries.append(LibraryAttach(lib.path, "torch", 0))
            return
        if self._fallback:
            from stacklens.introspect.elf import ElfFile

            self._op_names = list(FALLBACK_OPS)
            with ElfFile(lib.host_path) as elf:  # BCC takes a virtual address and converts it
                for o in ops:
                    self._bpf.attach_uprobe(name=lib.host_path.encode(), addr=elf.offset_to_vaddr(o.offset),
                                            fn_name=f"sl_op_entry_{wanted[o.name]}".encode(), pid=self.pid)
        else:
            base = len(self._op_names)
            self._op_names.extend(o.name for o in ops)
            self._links.append(self._link(self._op_entry.fd, lib.host_path, [o.offset for o in ops],
                                          list(range(base, base + len(ops)))))
        self._libraries.append(LibraryAttach(lib.path, "torch", len(ops)))

    def _attach_autograd(self, lib: LibraryFile, maps) -> None:
        """The forward→backward link's two entry points in libtorch_cpu (autograd.bpf.c), and
        the node classes' vtables of that file."""
        from stacklens.introspect.elf import ElfFile

        with ElfFile(lib.host_path) as elf:
            offsets = elf.symbol_offsets(list(autograd.SYMBOLS))
            mine = [m for m in maps if m.inode == lib.inode and m.dev == lib.dev]
            bias = elf.load_bias(mine) if mine else None
        missing = [s for s in autograd.SYMBOLS if s not in offsets]
        if missing or bias is None:
            self._notes.append(f"backward link: unavailable: {lib.path} does not export "
                               f"{'the autograd entry points' if missing else 'a mapping we can place'} "
                               "(backward work keeps the stacks of the autograd threads)")
            return
        self._vtables.add(lib.host_path, bias)
        self._add_node_classes(maps)
        if self._fallback:
            for i, sym in enumerate(autograd.SYMBOLS):
                self._bpf.attach_uprobe(name=lib.host_path.encode(), sym=sym.encode(),
                                        fn_name=f"sl_autograd_{i}".encode(), pid=self.pid)
        else:
            self._links.append(self._link(self._ag_entry.fd, lib.host_path,
                                          [offsets[s] for s in autograd.SYMBOLS], [0, 1]))
        self._notes.append("backward link: on (autograd nodes created and evaluated are probed)")

    def _add_node_classes(self, maps) -> None:
        """Node classes defined outside libtorch_cpu: PyNode (custom autograd.Function,
        checkpoint) in libtorch_python, CUDA-only nodes in libtorch_cuda."""
        from stacklens.introspect.elf import ElfFile

        for lib in find_libraries(self.pid, _NODE_LIBS_RE, maps=maps):
            mine = [m for m in maps if m.inode == lib.inode and m.dev == lib.dev]
            try:
                with ElfFile(lib.host_path) as elf:
                    bias = elf.load_bias(mine)
                self._vtables.add(lib.host_path, bias, symtab=True)
            except (StacklensError, OSError):
                continue   # its nodes keep their vtable address as the name

    def _node_event(self, kind: int, data, off: int, pid: int, tid: int, t: int, ops, pys) -> Event:
        """An autograd node event: its class (from the vtable), sequence number and forward thread."""
        node = _U64.unpack_from(data, off + _ARGS_REC)[0]
        blob = bytes(data[off + _BLOB_REC:off + _BLOB_REC + SL_BLOB])
        vptr, seq, thread, layout = autograd.decode_node(blob, node)
        name = self._vtables.name(vptr) or f"node@0x{vptr:x}"
        args = {"node": node, "seq": seq, "thread": thread, "layout": layout.name}
        if kind == SL_EV_NODE_NEW:
            return make_event("autograd_node", name, pid, tid, t, 0, args, ops, (), pys[0], py_entries=pys[1])
        return make_event("autograd_eval", name, pid, tid, t, 0, args, (), (), ())

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

    # ------------------------------------------------------------------ events
    def poll(self, timeout_ms: int = 100, max_events: int = 1 << 20) -> list[Event]:
        """Decoded events since the last poll (waits up to timeout_ms when none are ready).
        While this process is the program's only target its records are decoded straight from
        the mapped ring; otherwise the ring is sorted into per-process queues first."""
        shared = self._shared
        if self._reader is None or shared is None:
            return []
        if self.config.rescan_interval_s and time.monotonic() - self._last_scan > self.config.rescan_interval_s:
            try:
                self.rescan()
            except (NoSuchProcess, FileNotFoundError):
                self._last_scan = time.monotonic()
        reader = self._reader
        if timeout_ms and not reader.available() and not shared.queued(self.pid):
            reader.wait(timeout_ms)
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
                out = self._decode_ring(_RecordList(queued), 1 << 30) if queued else []
                if sole:
                    out += self._decode_ring(reader, max_events)
            return out
        finally:
            if was_enabled:
                gc.enable()

    def in_flight(self) -> list[Event]:
        """The return-probed calls entered and not yet returned (a sync still waiting), as their
        entry events (duration 0): what a window that ends now would otherwise never see."""
        if self._bpf is None:
            return []
        records = []
        try:
            for _key, val in self._bpf["pending"].items():
                if val.pid == self.pid:       # the pending map is the shared program's
                    records.append(ct.string_at(ct.addressof(val), ct.sizeof(val)))
        except (KeyError, OSError):
            return []
        return self._decode_ring(_RecordList(records), 1 << 30) if records else []

    def _shape(self, si: int) -> tuple:
        """Per probe spec, what the hot loop needs: (spec, kind, symbol, slot of the kernel
        handle or -1, kernel named from a host stub, blob copied, args decoded lazily)."""
        spec = self._specs[si]
        k = spec.kind
        kslot = spec.slots.get(spec.kernel, -1) if k == "launch" and spec.kernel else -1
        return (spec, k, spec.symbol, kslot, spec.kernel_from == "host_stub", bool(spec.struct_fields),
                k in ("launch", "graph", "sync"))

    def _decode_ring(self, reader: RingBufReader, max_events: int) -> list[Event]:
        """Walks the mapped ring once: one struct unpack per record for its header and event
        head, one more for the arguments of API events; each event is one tuple.__new__ (Event
        is a tuple subclass) and launch/graph/sync arguments stay raw until `Event.args` is
        read. The consumer position is handed back every COMMIT_BYTES, not only at the end, so
        a long batch does not keep the producers from the space already decoded."""
        out: list[Event] = []
        append = out.append
        rec, args_s = _REC.unpack_from, _ARGS.unpack_from
        data, mask = reader.data, reader.mask
        cons, prod = reader.positions()
        shapes = self._shapes
        stack_cache, op_cache, py_cache = self._stack_cache, self._op_cache, self._py_cache
        names = self._names
        new = _tuple_new
        me = self.pid
        commit_at = cons + COMMIT_BYTES
        while cons < prod:
            off = cons & mask
            (ln, _pg, kind, si, pid, tid, t, dur, oh, _od, sid, pyid, ret, outv, caller, bwd) = rec(data, off)
            if ln & BUSY:
                break
            cons += ((ln & 0x3FFFFFFF) + 15) & ~7
            if cons >= commit_at:
                reader.commit(cons)
                commit_at = cons + COMMIT_BYTES
                if len(out) >= max_events:
                    break
            if ln & DISCARD or pid != me:
                continue
            # a record's contents come from the target (arguments, names, stacks): one that
            # cannot be decoded is counted and dropped, never the end of the session
            try:
                if kind == SL_EV_NAME:
                    self._name_event(data, off + 8)
                    continue
                if sid < 0:
                    if sid == SL_STACK_INLINE:     # a CPU sample: its addresses follow the event
                        stack = self._inline_stack(data, off, min(outv, (ln & 0x3FFFFFFF) - _EVENT_SIZE))
                    else:
                        # -1: not requested; other negatives: the unwind failed (marked, not hidden)
                        stack = () if sid == -1 else TRUNCATED_STACK
                else:
                    stack = stack_cache.get((sid, caller))
                    if stack is None:
                        stack = self._stack(sid, caller)
                ops = op_cache.get(oh)
                if ops is None:
                    ops = self._op_path(oh)
                pys = py_cache.get(pyid)
                if pys is None:
                    pys = self._py_stack(pyid)
                if kind == SL_EV_SAMPLE:
                    append(new(Event, ("cpu_sample", "", pid, tid, t, 0, _NO_ARGS, ops, stack, pys[0], "", 0, "", 0,
                                       pys[1], bwd)))
                    continue
                if kind >= SL_EV_NODE_NEW:
                    append(self._node_event(kind, data, off, pid, tid, t, ops, pys))
                    continue
                sh = shapes.get(si)
                if sh is None:
                    sh = shapes[si] = self._shape(si)
                a = args_s(data, off + _ARGS_REC)
                blob = bytes(data[off + _BLOB_REC:off + _BLOB_REC + SL_BLOB]) if sh[5] else b""
                k = sh[1]
                if sh[6]:  # launch / graph / sync: nothing below needs the decoded arguments
                    kernel = ""
                    h = sh[3]
                    if h >= 0:
                        h = a[h]
                        if sh[4]:
                            kernel = self._symbolizer.exact_name(h) if h else "unresolved:0x0"
                        else:
                            kernel = names.get(h) or self._unresolved(h)
                    # args: raw (spec, values, blob), decoded by Event.args on access
                    append(new(Event, (k, sh[2], pid, tid, t, dur, (sh[0], a, blob), ops, stack, pys[0], kernel, 0,
                                       "", ret, pys[1], bwd)))
                    continue
                spec = sh[0]
                args = spec.decode(a, blob)
                nbytes = 0
                direction = ""
                if k == "alloc":
                    nbytes = args.get(spec.bytes_arg, 0)
                    args["ptr"] = outv
                    if ret == 0:
                        self._allocs[outv] = nbytes
                elif k == "free":
                    nbytes = self._allocs.pop(a[0], 0)
                elif k == "memcpy":
                    nbytes = args.get(spec.bytes_arg, 0)
                    direction = spec.direction or MEMCPY_KINDS.get(args.get(spec.direction_arg, -1), "unknown")
                append(make_event(k, spec.symbol, pid, tid, t, dur, args, ops, stack, pys[0], "", nbytes,
                                  direction, ret, pys[1], bwd))
            except Exception as e:  # noqa: BLE001 — see above
                self._user["records_undecodable"] += 1
                self._note_undecodable("ring record", e)
        reader.commit(cons)
        self._user["decoded"] += len(out)
        return out

    def _unresolved(self, h: int) -> str:
        name = self._unresolved_names.get(h)
        if name is None:
            name = f"unresolved:0x{h:x}"
            if len(self._unresolved_names) < 65536:
                self._unresolved_names[h] = name
        return name

    def _name_event(self, data, off: int) -> None:
        _, _, _, _, handle, ref = _NAME_HEAD.unpack_from(data, off)
        raw = bytes(data[off + _NAME_HEAD.size:off + _NAME_HEAD.size + SL_NAME])
        name = raw.split(b"\0", 1)[0].decode("utf-8", "replace")
        if not name and ref:
            name = self._names.get(ref, f"unresolved:0x{ref:x}")
        if handle:
            self._names[handle] = name

    def _inline_stack(self, data, off: int, nbytes: int) -> tuple[Frame, ...]:
        """The addresses a CPU sample carries after its event (innermost first), as frames;
        cached by the addresses themselves."""
        n = max(0, min(nbytes, STACK_DEPTH * 8)) // 8
        start = off + 8 + _EVENT_SIZE
        key = bytes(data[start:start + 8 * n])          # compact: at most 1 KiB a key
        frames = self._inline_cache.get(key)
        if frames is None:
            frames, cut = native_frames(list(struct.unpack(f"<{n}Q", key)), self._symbolizer.frame)
            if cut:
                self._user["truncated_stacks"] += 1
            if len(self._inline_cache) >= INLINE_CACHE_MAX:
                self._inline_cache.clear()
            self._inline_cache[key] = frames
        return frames

    def _stack(self, sid: int, caller: int = 0) -> tuple[Frame, ...]:
        table, key = (b"stacks2", sid & ~SL_STACK_IN_2) if sid & SL_STACK_IN_2 else (b"stacks", sid)
        try:
            addrs = list(self._bpf[table].walk(key))
        except Exception:
            addrs = []
        walked = len(addrs)
        if caller and addrs and (len(addrs) < 2 or addrs[1] != caller):
            addrs.insert(1, caller)  # the direct caller, skipped by the walk at function entry
        if not addrs:
            self._user["stack_lookup_failures"] += 1
            frames: tuple[Frame, ...] = (TRUNCATED,)
        else:
            frames, cut = native_frames(addrs, self._symbolizer.frame, walked)
            if cut:
                self._user["truncated_stacks"] += 1
        self._stack_cache[(sid, caller)] = frames
        return frames

    def _py_stack(self, pyid: int) -> tuple[tuple[Frame, ...], tuple[bool, ...]]:
        """Python stack `pyid` from `sl_py_stacks`, symbolized once per id (ids hash the frames'
        code addresses and offsets, so a cached id always names the same stack)."""
        from stacklens.bpf.pysym import RawPyStack

        if self._py is None:
            return (), ()
        table = self._py_table
        try:
            leaf = table[table.Key(pyid)]
        except KeyError:
            # LRU-evicted between the probe and this read: marked, not cached (it may come back)
            self._user["py_stacks_lost"] += 1
            return PY_LOST, (False,)
        raw = RawPyStack.from_bytes(bytes(leaf), self._py.max_depth)
        try:
            frames = self._py.symbolize(raw)
        except Exception as e:  # noqa: BLE001 — pysym counts and marks every bad object it knows;
            # anything else is a bug there, and still not the end of the session: marked, not cached
            self._user["py_stacks_undecodable"] += 1
            self._note_undecodable("python stack", e)
            return PY_UNDECODABLE, (False,)
        entries = self._py.symbolizer.entry_flags(raw)
        if raw.truncated:
            entries = (False,) + entries  # the leading [truncated] marker
        if len(self._py_cache) >= PY_CACHE_MAX:
            self._py_cache.clear()
            self._py_cache[0] = ((), ())
        v = (frames, entries)
        self._py_cache[pyid] = v
        self._user["py_stacks_symbolized"] += 1
        return v

    def _note_undecodable(self, what: str, e: Exception) -> None:
        """Keeps, for read_notes(), what raised where (the first few kinds), with the innermost
        frame of the traceback: enough to find the bug without a log."""
        import traceback

        tb = traceback.extract_tb(e.__traceback__)
        at = f" at {os.path.basename(tb[-1].filename)}:{tb[-1].lineno} ({tb[-1].name})" if tb else ""
        key = f"{type(e).__name__}: {e}"[:160]
        if key not in self._undecodable and len(self._undecodable) < UNDECODABLE_KEEP:
            self._undecodable[key] = f"{what}{at}"
            log.warning("pid %d: %s not decodable (counted, the session goes on)", self.pid, what, exc_info=e)

    def read_notes(self) -> list[str]:
        """The profile's notes on what was read from the target and could not be used: bad code
        objects, line tables and strings (counted by pysym, frames marked) and anything that
        raised while decoding (records dropped, stacks marked). [] when all went well."""
        out = []
        if self._py is not None:
            st = self._py.symbolizer.stats
            parts = [f"{n} {what}" for n, what in (
                (st.errors, "frame(s) without a readable code object [unreadable code object]"),
                (st.bad_strings, "code object name(s) not a str [unreadable code object name]"),
                (st.bad_linetables, "line table(s) not decodable (the frame shows the function's first line)"))
                if n]
            if parts:
                out.append("python frames read from freed or changing objects: " + ", ".join(parts)
                           + "; the session goes on")
        u = self._user
        if u["py_stacks_undecodable"] or u["records_undecodable"]:
            out.append(f"decode errors: {u['py_stacks_undecodable']} python stack(s) marked "
                       f"[python stack undecodable], {u['records_undecodable']} record(s) dropped; "
                       + "; ".join(f"{k} ({where})" for k, where in self._undecodable.items())
                       + " — a stacklens bug, please report it")
        return out

    def _op_path(self, h: int) -> tuple[str, ...]:
        table = self._bpf[b"op_paths"]
        try:
            p = table[table.Key(h)]
            names = self._op_names
            path = tuple(names[i] if i < len(names) else f"op#{i}" for i in p.ops[:p.depth])
        except KeyError:
            return ("[unknown op path]",)
        self._op_cache[h] = path
        return path

    # ------------------------------------------------------------------ aggregates / stats
    def op_counts(self) -> dict[tuple[str, ...], int]:
        """Operator calls counted in the kernel, by operator path (outermost first)."""
        if self._bpf is None or not self.config.ops:
            return {}
        out: dict[tuple[str, ...], int] = {}
        for h, n in self._op_hash_counts():
            path = self._op_cache.get(h) or self._op_path(h)
            out[path] = out.get(path, 0) + n
        return out

    def _op_hash_counts(self) -> list[tuple[int, int]]:
        """(path hash, calls) of this process's paths: the mmapped op_slots array, then the
        op_counts overflow map (both the shared program's: paths are told apart by owner)."""
        slots = self._shared.op_slots_view()
        hashes, counts = slots[0::2], slots[1::2]
        out = [(h, n) for h, n in zip(hashes, counts) if h and n]
        out += [(k.value, v.value) for k, v in self._bpf[b"op_counts"].items()]
        return [(h, n) for h, n in out if self._own_path(h)]

    def _own_path(self, h: int) -> bool:
        own = self._op_own.get(h)
        if own is None:
            table = self._bpf[b"op_paths"]
            try:
                own = table[table.Key(h)].tgid == self.pid
            except KeyError:
                return False          # not named yet (or the map was full): asked again later
            self._op_own[h] = own
        return own

    @property
    def libraries(self) -> tuple[LibraryAttach, ...]:
        """Every library file found so far (attach and rescans), with its probe count."""
        return tuple(self._libraries)

    def kernel_names(self) -> dict[int, str]:
        return dict(self._names)

    def stats(self) -> dict[str, int]:
        out = {name: 0 for name in COUNTERS}
        if self._shared is not None and self._slot >= 0:
            out.update(self._shared.counters(self._slot))
        if self._bpf is not None and self.config.ops:
            # counted per op path (the op probe keeps no separate per-hit counter)
            out["op_calls"] = sum(n for _, n in self._op_hash_counts())
        out["unwind_errors"] = out["stack_errors"] + self._user["stack_lookup_failures"]
        out.update(self._user)
        out["links"] = len(self._links)
        if self._shared is not None:
            out["fallback_full"] = self._shared.fallback_full   # the program's (not told apart by process)
            out["unpolled_drops"] = self._shared.dropped.get(self.pid, 0)
        if self._py is not None:
            st = self._py.symbolizer.stats
            out.update(py_code_hits=st.hits, py_code_misses=st.misses, py_code_stale=st.stale,
                       py_code_errors=st.errors, py_bad_linetables=st.bad_linetables,
                       py_bad_strings=st.bad_strings)
        return out

    def python_info(self) -> dict:
        """How Python stacks are read in this session (`stacklens doctor`); {} if they are not."""
        return self._py.describe() if self._py is not None else {}

    @property
    def source(self) -> str:
        """The C text and cflags this session compiled (`--dump-bpf`)."""
        return self._source.render()

    # ------------------------------------------------------------------ detach
    def detach(self) -> None:
        """Remove every probe; safe to call twice and after a failed attach. The compiled
        program goes back to POOL for the next attach."""
        links, self._links = self._links, []
        for fd in links:
            try:
                os.close(fd)
            except OSError:
                pass
        shared, self._shared = self._shared, None
        if shared is not None:
            try:
                shared.remove_target(self.pid, self._slot)
                if self._py is not None:
                    self._py.forget_threads(shared.bpf)
            except Exception:  # noqa: BLE001 — an unusable program is not reused
                POOL.discard(self._key, shared)
            else:
                if self._fallback:    # its per-probe uprobes go with the module (bpf.cleanup)
                    POOL.discard(self._key, shared)
                else:
                    POOL.release(self._key, shared)
        self._reader = None
        self._bpf = None
        self._slot = -1
        self.attached = False
        py, self._py = self._py, None
        if py is not None:
            try:
                py.mem.close()
            except Exception:
                pass

    def __enter__(self) -> "ProbeSession":
        self.attach()
        return self

    def __exit__(self, *exc) -> None:
        self.detach()


_UPROBE_MULTI: bool | None = None


def _uprobe_multi_supported() -> bool:
    """Kernel >= 6.6 with CONFIG_UPROBES: checked once via the kernel version."""
    global _UPROBE_MULTI
    if _UPROBE_MULTI is None:
        m = re.match(r"(\d+)\.(\d+)", os.uname().release)
        _UPROBE_MULTI = bool(m) and (int(m.group(1)), int(m.group(2))) >= (6, 6)
    return _UPROBE_MULTI
