"""JAX: GPU kernels charged to the jitted Python source through XLA's fusion metadata.

The agent (``inject/agent/jaxmeta.py``) sends, per compiled XLA module, the instructions that can
launch kernels (in schedule order) with the original JAX operators each was fused from. XLA names
the kernel of a fusion after its instruction (``loop_add_fusion.3`` → ``loop_add_fusion_3``), so a
kernel record whose name matches an instruction is split over that instruction's operators:

    py:<call site> … → py:<source line of the operator> → op:jit(step)/dot_general → [native/api] → kernel:<name>

Rules (also written into the snapshot's ``meta["notes"]`` and ``meta["jax"]``):
- **even split**: a kernel's ``gpu_time_ns`` is divided evenly among the distinct original
  operators (op_name, file, line) of its instruction (remainder to the first); its ``kernel_count``
  (1) goes to the first operator's path only, so totals stay exact.
- **name match**: kernel name == instruction name, after replacing every character outside
  ``[A-Za-z0-9_]`` with ``_``; a trailing ``_impl``/``_kernel`` is also tried. Among modules holding
  the name: for a kernel of a CUDA graph (XLA command buffer, ``graph_id`` != 0) the module that
  graph's kernels matched before; else the module of the previous matched kernel on the same stream
  (same graph) if the name comes later in its schedule; else the module with the most kernels
  matched so far (on a tie the larger module, then the newest).
- **launch order** (library kernels — cuBLAS/cuDNN — carry the library's own names): an unmatched
  kernel on a stream (a graph's kernels: in that graph) whose previous kernel matched instruction
  *i* of module M is charged to the custom-call instructions that follow *i* in M's schedule
  before the next fusion: split evenly over them, or, once the previous run of library kernels
  after *i* (up to the next named kernel) had exactly as many kernels as there are such custom
  calls, the k-th kernel to the k-th custom call. Marked in ``meta["jax"]["by_order"]``; no
  candidate → the kernel keeps its plain path (``unmatched``).
- **transposed op**: a backward operator without a source line (``…/transpose(jvp())/mul``) takes
  the line of the forward operator it transposes (``…/jvp()/mul``) where exactly one located
  operator of the module has that name; else it stays without one.
- Compile events (``jax.monitoring`` trace/lowering/backend compile durations) add
  ``compile_time_ns`` to the user call site that triggered them.
"""

from __future__ import annotations

import collections
import re
from dataclasses import dataclass
from typing import NamedTuple

from stacklens.cct import Frame
from stacklens.records.agent import CompileRecord, HloMapRecord, KernelRecord

COMPILE_METRIC = "compile_time_ns"
SPLIT_NOTE = ("jax: a fused kernel's gpu_time_ns is split evenly among the distinct original operators "
              "(op_name, source line) of its XLA instruction, kernel_count to the first; kernels named "
              "after no instruction (cuBLAS/cuDNN) are matched by launch order to the custom calls that "
              "follow the previous matched kernel (meta jax.by_order)")
MAX_MODULES = 4096
MAX_GRAPHS = 4096
MAX_RUNS = 1 << 16
_SANITIZE = re.compile(r"[^A-Za-z0-9_]")
_SUFFIXES = ("_impl", "_kernel")
LIBRARY_OPCODES = ("custom-call",)


class Charge(NamedTuple):
    """Metrics to add at one path of the tree."""
    path: tuple[Frame, ...]
    metrics: dict[str, int]


def sanitize(name: str) -> str:
    return _SANITIZE.sub("_", name)


@dataclass
class _Module:
    module_id: str
    name: str
    platform: str
    site: tuple[Frame, ...]
    entries: list            # [(instruction name, opcode, ops)] in schedule order
    parts: dict              # part index -> kernels (until all have arrived)
    nparts: int
    by_name: dict            # sanitized instruction name -> entry index
    by_instr: dict           # raw instruction name -> entry index

    def operators(self, idxs) -> tuple:
        """The distinct operators of the entries `idxs`, in order (the split's operator list)."""
        ops: dict = {}
        for i in idxs:
            for o in self.entries[i][2]:
                ops.setdefault(tuple(o), None)
        return tuple(ops)


class JaxIndex:
    """Fusion maps of one process's XLA modules; owned by the aggregation thread.

    The join's splitter (held by `GpuCharges`, daemon/join/charges.py): it feeds the JAX records in
    (`on_record`) and asks for the split of each kernel (`split`); what to add to the tree comes
    back as `Charge`s, the join adds them."""

    def __init__(self) -> None:
        self.modules: dict[str, _Module] = {}
        self._holders: dict[str, list[str]] = {}       # sanitized name -> module ids, newest last
        # (device, stream) or ("g", device, graph) -> [module id, idx of the last named kernel,
        # library kernels seen since]
        self._last: dict[tuple, list] = {}
        self._runlen: dict[tuple[str, int], int] = {}  # (module id, idx) -> library kernels that followed it last time
        self._graph_module: dict[tuple[int, int], str] = {}  # (device, graph id) -> module id of its kernels
        self._hits: collections.Counter = collections.Counter()    # module id -> kernels matched by name
        self.stats = {"modules": 0, "matched": 0, "by_order": 0, "unmatched": 0, "compile_events": 0}

    # ---- feeding ---------------------------------------------------------------------------
    def on_record(self, rec: HloMapRecord | CompileRecord) -> list[Charge]:
        """Take a JAX record: a fusion map is kept, a compile event is charged."""
        if type(rec) is HloMapRecord:
            self.add_hlo(rec)
            return []
        return [self.compile_charge(rec)]

    def add_hlo(self, rec: HloMapRecord) -> None:
        m = self.modules.get(rec.module_id)
        if m is not None and m.entries:                   # complete: the same module sent again
            if rec.site and not m.site:
                m.site = tuple(Frame.python(f, fn, ln) for f, fn, ln in rec.site)
            return
        if m is None or m.nparts != rec.parts:
            if len(self.modules) >= MAX_MODULES:
                self._forget(next(iter(self.modules)))
            m = _Module(rec.module_id, rec.module, rec.platform,
                        tuple(Frame.python(f, fn, ln) for f, fn, ln in rec.site), [], {}, rec.parts, {}, {})
            self.modules[rec.module_id] = m
        m.parts[rec.part] = rec.kernels
        if rec.site and not m.site:
            m.site = tuple(Frame.python(f, fn, ln) for f, fn, ln in rec.site)
        if len(m.parts) == m.nparts:
            for i in range(m.nparts):
                for k in m.parts[i]:
                    m.entries.append((k.name, k.opcode, tuple(k.ops)))
            _forward_lines(m.entries)
            for i, (name, _opcode, _ops) in enumerate(m.entries):
                m.by_instr.setdefault(name, i)
                m.by_name.setdefault(sanitize(name), i)
            for s in m.by_name:
                holders = self._holders.setdefault(s, [])
                if m.module_id in holders:
                    holders.remove(m.module_id)
                holders.append(m.module_id)
            self.stats["modules"] = len(self.modules)

    def _forget(self, mid: str) -> None:
        m = self.modules.pop(mid, None)
        self._hits.pop(mid, None)
        for g in [g for g, v in self._graph_module.items() if v == mid]:
            del self._graph_module[g]
        if m is None:
            return
        for s in m.by_name:
            h = self._holders.get(s)
            if h and mid in h:
                h.remove(mid)

    def compile_charge(self, rec: CompileRecord) -> Charge:
        """The path and metrics a CompileRecord adds: its call site, compile_time_ns."""
        self.stats["compile_events"] += 1
        path = tuple(Frame.python(f, fn, ln) for f, fn, ln in rec.frames)
        if not path:
            path = (Frame.other(f"jax compile {rec.fun_name}" if rec.fun_name else "jax compile"),)
        return Charge(path, {COMPILE_METRIC: rec.duration_ns})

    # ---- lookups ---------------------------------------------------------------------------
    def _find(self, kernel_name: str, key: tuple, graph: tuple[int, int] | None) -> tuple[_Module, int, bool] | None:
        """(module, entry index, certain) of a kernel name; certain: one module holds it, or the
        graph's module does."""
        s = sanitize(kernel_name)
        names = [s] + [s[: -len(x)] for x in _SUFFIXES if s.endswith(x)]
        last = self._last.get(key)
        gmod = self._graph_module.get(graph) if graph is not None else None
        for n in names:
            holders = self._holders.get(n)
            if not holders:
                continue
            certain = True
            if len(holders) == 1:
                mid = holders[0]
            elif gmod is not None and gmod in holders:
                mid = gmod              # a graph's kernels are all of one executable
            elif last is not None and last[0] in holders and self.modules[last[0]].by_name[n] > last[1]:
                mid, certain = last[0], False   # the module running on this stream, moving forward in it
            else:                       # the executable that ran most so far; larger, then newest on a tie
                hits, mods = self._hits, self.modules
                mid = max(enumerate(holders),
                          key=lambda x: (hits.get(x[1], 0), len(mods[x[1]].entries), x[0]))[1]
                certain = False
            m = self.modules[mid]
            return m, m.by_name[n], certain
        return None

    def resolve(self, kernel_name: str, device: int = 0, stream: int = 0, graph_id: int = 0):
        """(module, [entry indices], rule) for a kernel, rule "name" or "order"; None if unknown.
        A kernel launched from a CUDA graph (``graph_id`` != 0: XLA command buffers) is resolved
        within its graph: the graph's module, the previous kernel of the same graph."""
        graph = (device, graph_id) if graph_id else None
        key = ("g", device, graph_id) if graph_id else (device, stream)
        hit = self._find(kernel_name, key, graph)
        if hit is not None:
            m, i, certain = hit
            prev = self._last.get(key)
            if prev is not None and prev[2]:
                if len(self._runlen) >= MAX_RUNS:
                    self._runlen.clear()
                self._runlen[(prev[0], prev[1])] = prev[2]
            elif prev is None and len(self._last) >= 2 * MAX_GRAPHS:
                self._last.pop(next(iter(self._last)))
            self._last[key] = [m.module_id, i, 0]
            self._hits[m.module_id] += 1
            if graph is not None and (certain or graph not in self._graph_module):
                if graph not in self._graph_module and len(self._graph_module) >= MAX_GRAPHS:
                    self._graph_module.pop(next(iter(self._graph_module)))
                self._graph_module[graph] = m.module_id
            return m, [i], "name"
        last = self._last.get(key)
        if last is None or last[0] not in self.modules:
            return None
        m = self.modules[last[0]]
        cands = []
        for j in range(last[1] + 1, len(m.entries)):
            opcode = m.entries[j][1]
            if opcode in LIBRARY_OPCODES:
                cands.append(j)
            elif opcode == "fusion":       # the next fusion has its own (named) kernel
                break
        if not cands:
            return None
        k = last[2]
        last[2] += 1
        if len(cands) > 1 and k < len(cands) and self._runlen.get((last[0], last[1])) == len(cands):
            return m, [cands[k]], "order"   # as many library kernels as custom calls last time: one each
        return m, cands, "order"

    def module_named(self, module_name: str, instructions) -> _Module | None:
        """The module of that name whose instructions are looked up for jax.profiler's
        hlo_module/hlo_op stats: of the complete modules of that name, the one holding most of
        `instructions` (raw instruction names: the distinct hlo_ops the trace shows for it), then the
        larger, then the newest; None if none holds any. Keyed by module NAME only (the profiler
        gives no fingerprint), so a module recompiled under the same name (same instruction names,
        maybe other operators) is never mixed in instruction by instruction."""
        instructions = set(instructions)
        best = None
        for pos, m in enumerate(self.modules.values()):
            if m.name != module_name or not m.entries:
                continue
            k = (len(instructions & m.by_instr.keys()), len(m.entries), pos)
            if best is None or k > best[0]:
                best = (k, m)
        return best[1] if best is not None and best[0][0] else None

    # ---- the split -------------------------------------------------------------------------
    def split(self, path: tuple[Frame, ...], krec: KernelRecord) -> list[Charge] | None:
        """Paths and metrics for one kernel record charged at `path` (the launching path, ending
        or not with its kernel frame); None if the kernel is not one of a known XLA module."""
        r = self.resolve(krec.name, getattr(krec, "device", 0), getattr(krec, "stream", 0),
                         getattr(krec, "graph_id", 0) or 0)
        if r is None:
            if self.modules:
                self.stats["unmatched"] += 1
            return None
        m, idxs, rule = r
        self.stats["matched" if rule == "name" else "by_order"] += 1
        return split_paths(path, krec.name, max(0, krec.end_ns - krec.start_ns), m.operators(idxs))

    def meta(self) -> dict[str, int]:
        return dict(self.stats)


def forward_op_name(op_name: str) -> str:
    """The forward operator a transposed one differentiates: every ``transpose(X)`` in the name
    read as ``X`` (``jit(step)/transpose(jvp())/mul`` -> ``jit(step)/jvp()/mul``)."""
    while True:
        i = op_name.find("transpose(")
        if i < 0:
            return op_name
        depth, j = 0, i + len("transpose(")
        while j < len(op_name) and (op_name[j] != ")" or depth):
            depth += {"(": 1, ")": -1}.get(op_name[j], 0)
            j += 1
        op_name = op_name[:i] + op_name[i + len("transpose("):j] + op_name[j + 1:]


def _forward_lines(entries: list) -> None:
    """Rule "transposed op": a backward operator XLA left without a source line takes the line of
    the forward operator it transposes, where its name (``forward_op_name``) names exactly one
    located operator of the module; otherwise it stays without one."""
    located: dict[str, set] = {}
    for _name, _opcode, ops in entries:
        for op_name, file, line, func in ops:
            if file:
                located.setdefault(op_name, set()).add((file, line, func))
    for k, (name, opcode, ops) in enumerate(entries):
        if all(o[1] or "transpose(" not in o[0] for o in ops):
            continue
        new = []
        for op_name, file, line, func in ops:
            at = located.get(forward_op_name(op_name)) if not file and "transpose(" in op_name else None
            new.append((op_name, *next(iter(at))) if at and len(at) == 1 else (op_name, file, line, func))
        entries[k] = (name, opcode, tuple(new))


def split_paths(path: tuple[Frame, ...], kernel: str, gpu_ns: int, ops: tuple) -> list[Charge]:
    """The even split of one kernel over its operators.

    `path`: the launching path (python frames, then native/api frames, optionally the kernel).
    Each operator gets: leading python frames + its source line (if known) + op frame + the
    rest of the launching path + kernel frame; gpu_time_ns // n each (remainder to the first),
    kernel_count 1 on the first only. No operators: the plain path with everything.
    """
    p = tuple(path)
    if p and p[-1].kind == "kernel":
        p = p[:-1]
    n_py = 0
    while n_py < len(p) and p[n_py].kind == "python":
        n_py += 1
    head, tail = p[:n_py], p[n_py:]
    kf = Frame.kernel(kernel)
    if not ops:
        return [Charge(p + (kf,), {"gpu_time_ns": gpu_ns, "kernel_count": 1})]
    n = len(ops)
    share, rem = divmod(gpu_ns, n)
    out = []
    for i, (op_name, file, line, func) in enumerate(ops):
        src = (Frame.python(file, func or "?", line),) if file else ()
        out.append(Charge(head + src + (Frame.op(op_name),) + tail + (kf,),
                          {"gpu_time_ns": share + (rem if i == 0 else 0), "kernel_count": 1 if i == 0 else 0}))
    return out
