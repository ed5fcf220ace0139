"""GPU records charged to the tree where the session's `GpuJoin` says they belong.

Pure (no privilege, no I/O; C++ names are demangled by the function the `Joiner` hands in); runs on
the process's aggregation thread, inside the join.

The session's `GpuJoin` hands its verdicts to the `Joiner` (its `Charges`, daemon/join/gpujoin.py),
which passes them to `GpuCharges` (the same methods):
- kernels: GPU time and a count on the launching path's `kernel:NAME` (the launch's kernel frame
  named from CUPTI, an unresolved handle's name learnt on the way), split over JAX's operators
  (`JaxIndex`, daemon/join/jaxjoin.py) or over a CUDA graph's nodes (`GraphSplit`,
  daemon/join/graphs.py); what no launch claims under `[launch not seen]`;
- copies and memsets: see the comment above `copy_call`.

Cost (issue 9): the common kernel (its launching path and name seen before, no JAX) is one memo
lookup and one `WindowedCCT.stage_pair`; the charged path is the same tuple object each time.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Callable

from stacklens.cct import Frame, WindowedCCT
from stacklens.daemon.join.gpujoin import CopyCall, Path
from stacklens.daemon.join.graphs import GRAPH_NOTE, GraphSplit
from stacklens.daemon.join.jaxjoin import SPLIT_NOTE, JaxIndex
from stacklens.daemon.join.stats import JoinStats, add_note
from stacklens.records.agent import CompileRecord, HloMapRecord, KernelRecord, MemcpyRecord

if TYPE_CHECKING:
    from stacklens.records.events import Event

HANDLE_NAMES_MAX = 65_536
CHARGE_MEMO_MAX = 65_536     # launching paths with memoized charges; cleared when full
NAMES_PER_LAUNCH = 1024      # kernel names memoized per launching path
_UNSEEN = (Frame.other("[launch not seen]"),)  # one tuple: its charges are staged together
_COPY_UNSEEN = (Frame.other("[copy call not seen]"),)
_MEMSET_UNIT = re.compile(r"MemsetD(8|16|32)")


class _Charged:
    """Where a kernel of one name, launched at one path, is charged: the charged path (… →
    kernel:NAME), the unresolved handle its launch named (or None), and the demangled name."""
    __slots__ = ("path", "handle", "kname")

    def __init__(self, path: Path, handle: str | None, kname: str) -> None:
        self.path, self.handle, self.kname = path, handle, kname


class _LaunchCharges:
    """The charge memo of one launching path (kept alive here, so its id is its own)."""
    __slots__ = ("launch", "by_name")

    def __init__(self, launch: Path) -> None:
        self.launch = launch
        self.by_name: dict[str, _Charged] = {}


class GpuCharges:
    """One process's GPU records, charged to its tree (`tree`), counted in `stats`, described in
    `meta`. `handle_names` ("unresolved:0x…" → kernel name) is filled here, read by the paths of
    later launches (`EventPaths`) and by snapshots (rename.py)."""

    def __init__(self, tree: WindowedCCT, stats: JoinStats, meta: dict, graphs: GraphSplit, *, agent: bool,
                 demangle: Callable[[str], str], handle_names: dict[str, str]) -> None:
        self.tree, self.stats, self.meta, self.graphs = tree, stats, meta, graphs
        self.agent = agent
        self.handle_names = handle_names
        self._demangle = demangle
        # GPU time is measured only while the agent's GPU collector runs (CUPTI/RocTracer active)
        self.gpu_collector_active = False
        self.jax: JaxIndex | None = None   # once the agent sends JAX records
        # id(launching path) -> its charge memo; an entry keeps its path alive, so ids stay unique
        self._charge_memo: dict[int, _LaunchCharges] = {}
        self._copy_frames: dict[tuple[str, str], Frame] = {}
        self._memset_units: dict[str, int] = {}
        self._i_gpu = tree.metric_index("gpu_time_ns")
        self._i_kernels = tree.metric_index("kernel_count")

    # ---- kernels -----------------------------------------------------------------------------
    def kernel(self, path: Path, rec: KernelRecord) -> None:
        """A kernel joined to its launching path: staged on the memoized charged path (the common
        case: the path and the record's name seen before; not with JAX, which splits kernels by
        operator), learning an unresolved handle's name from CUPTI."""
        self.gpu_collector_active = True
        self.stats.kernels_joined += 1
        if self.jax is None:
            if rec.graph_id:                    # a node of a CUDA-graph replay
                p = self.graphs.known(path, rec) if rec.graph_node_id else None
                if p is None:
                    self.graph_kernels(self.graphs.kernel(path, rec))
                    return
                d = rec.end_ns - rec.start_ns
                self.tree.stage_pair(p, self._i_gpu, d if d > 0 else 0, self._i_kernels, 1)
                return
            e = self._charge_memo.get(id(path))
            if e is not None:
                hit = e.by_name.get(rec.name)
                if hit is not None:
                    if hit.handle is not None and len(self.handle_names) < HANDLE_NAMES_MAX and not rec.graph_id:
                        self.handle_names[hit.handle] = hit.kname
                    d = rec.end_ns - rec.start_ns
                    self.tree.stage_pair(hit.path, self._i_gpu, d if d > 0 else 0, self._i_kernels, 1)
                    return
        self._charge_new(path, rec)

    def graph_kernels(self, charges) -> None:
        """Kernels of CUDA-graph replays as `GraphSplit` charged them: (path, record) each."""
        if not charges:
            return
        if "graphs" not in self.meta:
            add_note(self.meta, GRAPH_NOTE)
        for p, r in charges:
            d = r.end_ns - r.start_ns
            self.tree.stage_pair(p, self._i_gpu, d if d > 0 else 0, self._i_kernels, 1)
        self.meta["graphs"] = self.graphs.meta()       # counts change only here

    def kernel_unseen(self, rec: KernelRecord) -> None:
        self.gpu_collector_active = True
        self.stats.kernels_unmatched += 1
        self._charge_new(_UNSEEN, rec)

    def kernel_lost(self) -> None:
        self.stats.kernels_unmatched += 1

    def launch_dropped(self) -> None:
        self.stats.launches_unmatched += 1

    def _charge_new(self, path: Path, krec: KernelRecord) -> None:
        """`kernel`'s first time for this (path, kernel name), or any JAX kernel: the charged path
        (the launch's kernel frame named from CUPTI), split by JAX, memoized."""
        kname = self._demangle(krec.name)
        charged, handle = path, None
        if path[-1].kind != "kernel":
            charged = path + (Frame.kernel(kname),)
        elif path[-1].name != kname and path[-1].name.startswith("unresolved:"):
            # the handle's name, learnt from CUPTI: later launches of it land on the named node
            handle = path[-1].name
            if len(self.handle_names) < HANDLE_NAMES_MAX and not krec.graph_id:
                self.handle_names[handle] = kname
            charged = path[:-1] + (Frame.kernel(kname),)
        split = self.jax.split(charged, krec) if self.jax is not None else None
        if split is not None:  # a JAX kernel: one path per original operator (jaxjoin's rule)
            for c in split:
                self.tree.add_many(c.path, c.metrics)
            self.meta["jax"] = self.jax.meta()
            return
        if self.jax is None:
            memo = self._charge_memo
            e = memo.get(id(path))
            if e is None:
                if len(memo) >= CHARGE_MEMO_MAX:
                    memo.clear()
                e = memo[id(path)] = _LaunchCharges(path)
            if len(e.by_name) < NAMES_PER_LAUNCH:
                e.by_name[krec.name] = _Charged(charged, handle, kname)
        d = krec.end_ns - krec.start_ns
        self.tree.stage_pair(charged, self._i_gpu, d if d > 0 else 0, self._i_kernels, 1)

    def on_jax_record(self, rec: HloMapRecord | CompileRecord) -> None:
        """A JAX record goes to the splitter (created on first use, its rule added to the notes);
        a compile event comes back as a charge at its call site."""
        if self.jax is None:
            self.jax = JaxIndex()
            add_note(self.meta, SPLIT_NOTE)
        for c in self.jax.on_record(rec):
            self.tree.add_many(c.path, c.metrics)
        self.meta["jax"] = self.jax.meta()

    # ---- copies and memsets (CUPTI MEMCPY / MEMSET activity) ---------------------------------
    # A copy or memset call seen by BPF (`kind = "memcpy"` probes; memsets have direction
    # "memset") adds its CPU time at once under `… → api:NAME`. With an agent the call then waits
    # (a `CopyCall`, in the GpuJoin) for its CUPTI record, which charges GPU time, bytes and a
    # count to `… → api:NAME → memcpy:DtoH (Device -> Pinned)` / `memset:Device`; the bytes the
    # call asked for are added under `api:NAME` only if no record claims it, so bytes are never
    # counted twice. Claims: by order (records in correlation-id order claim calls whose
    # (memcpy|memset, bytes) match) or exactly (API records of copy calls claim the thread's call
    # inside their interval, as launches). A copy node of a CUDA graph joins with the graph's
    # kernels. A record no call claims lands under `[copy call not seen]`: its GPU time stays in
    # the totals, counted in `copies_unjoined`.

    def copy_call(self, ev: Event, path: Path) -> CopyCall | None:
        """A copy or memset call at `path` (… → api:NAME): its CPU time (and, without an agent,
        its bytes) now; with an agent, the call that waits for its record."""
        memset = getattr(ev, "direction", "") == "memset"
        nbytes = ev.bytes * self._memset_unit(ev.api) if memset else ev.bytes
        if not self.agent:
            self.tree.add_many(path, {"memset_bytes" if memset else "copy_bytes": nbytes,
                                      "api_cpu_ns": getattr(ev, "duration_ns", 0)})
            return None
        self.tree.add_many(path, {"api_cpu_ns": getattr(ev, "duration_ns", 0)})
        return CopyCall(ev.ktime_ns, path, nbytes, "memset" if memset else "memcpy")

    def _memset_unit(self, api: str) -> int:
        """Bytes per element of a memset call (cuMemsetD32Async: 4); 1 for byte counts."""
        u = self._memset_units.get(api)
        if u is None:
            m = _MEMSET_UNIT.search(api)
            u = int(m.group(1)) // 8 if m else 1
            if len(self._memset_units) < 4096:
                self._memset_units[api] = u
        return u

    def copy_dropped(self, call: CopyCall) -> None:
        self.tree.add_many(call.path, {call.metric: call.nbytes})
        ex = self.stats.extra
        ex["copy_calls_unmatched"] = ex.get("copy_calls_unmatched", 0) + 1

    def copy(self, path: Path, rec: MemcpyRecord) -> None:
        """GPU time, bytes and a count of one record under the path of the call (or graph
        launch) that issued it."""
        ex = self.stats.extra
        ex["copies_joined"] = ex.get("copies_joined", 0) + 1
        self._add_copy(path, rec)

    def copy_unseen(self, rec: MemcpyRecord) -> None:
        ex = self.stats.extra
        ex["copies_unjoined"] = ex.get("copies_unjoined", 0) + 1
        self._add_copy(_COPY_UNSEEN, rec)

    def _add_copy(self, path: Path, rec: MemcpyRecord) -> None:
        self.gpu_collector_active = True
        d = rec.end_ns - rec.start_ns
        if rec.kind == "memset":
            m = {"gpu_time_ns": d if d > 0 else 0, "memset_count": 1, "memset_bytes": rec.bytes}
        else:
            m = {"gpu_time_ns": d if d > 0 else 0, "memcpy_count": 1, "copy_bytes": rec.bytes}
        self.tree.add_many(path + (self._copy_frame(rec),), m)

    def _copy_frame(self, rec: MemcpyRecord) -> Frame:
        key = (rec.kind, rec.memory)
        f = self._copy_frames.get(key)
        if f is None:
            if rec.kind == "memset":
                f = Frame.memset(rec.memory or "Unknown")
            else:
                f = Frame.memcpy(f"{rec.kind} ({rec.memory})" if rec.memory else rec.kind)
            if len(self._copy_frames) < 4096:
                self._copy_frames[key] = f
        return f
