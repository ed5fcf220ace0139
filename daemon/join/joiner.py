"""The join: BPF events and agent records of one process folded into its calling context tree.

Runs on the process's aggregation thread only (no locks in here). No privilege.

Paths read  py frames → C extension → op frames → native frames → api:… → kernel:…  (outermost
first; `splice()` puts native frames between Python runs where the eval loop's frames allow).
- CPU samples (BPF perf event): py + ops + native; counted by thread too (the event's tid, as are
  the agent's Python samples: `CCT.add_sample`), the threads named once, when first seen, by the
  `thread_name` the session gives (the comm: `ProcFS.thread_comm`), for pprof's thread labels.
- Launches: py + ops + native + api + kernel; `launch_count` at once. GPU time arrives later from
  the agent (CUPTI): the session's `GpuJoin` (daemon/join/gpujoin.py) says which launch each kernel
  record belongs to — by launch order (`LaunchOrderJoin`, daemon/join/orderjoin.py) or exactly through
  CUPTI API records (`ApiRecordJoin`, daemon/join/apijoin.py) — and `gpu_time_ns` and `kernel_count`
  are charged to that launching path. What cannot be joined is counted, never guessed.
  Launches counted on `kernel:unresolved:0x…` before CUPTI named the handle: renamed in snapshots (rename.py).
- Copies and memsets: `… → api:cuMemcpyAsync → memcpy:DtoH (Device -> Pinned)` / `… →
  memset:Device` with GPU time, bytes and counts from CUPTI (see `_on_copy_call`), joined by the
  same `GpuJoin`.
- Without an agent `gpu_time_ns`, `kernel_count`, `memcpy_count` and `memset_count` are marked
  unavailable in every snapshot.

Cost (issue 9: ~25k launches/s and as many kernel records on an H200 ViT job, one thread): the
launch and kernel paths are memoized tuples (the same object for the same stacks, api, kernel),
so their counts are staged in the tree by path identity (`WindowedCCT.stage`) and applied once
per distinct path when the tree flushes: at every `expire()` (the session calls it every 0.2 s),
when time moves to a new window bucket (staged values land in the bucket they were staged in),
before every snapshot (nothing staged is ever missing from one) and at `finish()`. The session
does not call `Joiner.flush()`; it is there for callers that want the counts in the tree sooner.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

from stacklens.cct import Frame, Snapshot, WindowedCCT, metrics
from stacklens.daemon.join.apijoin import ApiRecordJoin
from stacklens.daemon.join.backward import BackwardLink
from stacklens.daemon.join.compiled import COMPILED_NOTE, InductorIndex
from stacklens.daemon.join.gpujoin import CopyCall, GpuJoin, Path
from stacklens.daemon.join.graphs import GRAPH_NOTE, GraphSplit
from stacklens.daemon.join.jaxjoin import SPLIT_NOTE, JaxIndex
from stacklens.daemon.join.orderjoin import LaunchOrderJoin
from stacklens.daemon.join.rename import name_launches
from stacklens.daemon.join.splice import sample_frames, splice
from stacklens.records.agent import (AgentRecord, AgentStats, ApiRecord, CompileRecord, HloMapRecord, InductorRecord,
                                      JoinKind, KernelRecord, MemcpyRecord, Note, PySample)

if TYPE_CHECKING:
    from stacklens.records.events import Event

# Every metric of the registry (cct/metrics.py); py_samples (the in-process sampler) is kept apart
# from the BPF cpu_samples so neither is double counted.
DAEMON_METRICS = metrics.ALL
GPU_MEASURED = tuple(m.name for m in metrics.REGISTRY if m.needs == "gpu")  # unavailable without it

HANDLE_NAMES_MAX = 65_536
THREAD_NAMES_MAX = 4096   # threads named per process; later ones keep their tid only
_UNSEEN = (Frame.other("[launch not seen]"),)  # one tuple: its charges are staged together
# GPU copies and memsets (CUPTI MEMCPY / MEMSET activity), see `_on_copy_call`
_COPY_UNSEEN = (Frame.other("[copy call not seen]"),)
_MEMSET_UNIT = re.compile(r"MemsetD(8|16|32)")


def _demangle(name: str) -> str:
    # libstdc++'s demangler through ctypes: loaded at the first kernel, so the join imports pure
    from stacklens.introspect.demangle import demangle
    return demangle(name)


AGENT_DROP_KINDS = ("samples", "gpu", "gpu_buffers", "messages", "jax", "inductor")
AGENT_STAT_MAX = 1 << 53


def _agent_gauge(v) -> int:
    """A number the target reported, as a stats value: never negative, never huge (the values
    are summed into uint64 fields across processes: Health, /metrics)."""
    try:
        return min(max(0, round(v)), AGENT_STAT_MAX)
    except (TypeError, ValueError, OverflowError):
        return 0


# metrics a live profile measures only in part: what each lacks (snapshot meta["partial"])
PARTIAL = {"api_cpu_ns": "kernel launch API time is not measured: launch probes are entry-only (a return "
                         "probe costs more than a launch); api_cpu_ns holds allocations, frees and "
                         "synchronous copies"}


@dataclass
class JoinStats:
    events: int = 0
    cpu_samples: int = 0
    launches: int = 0
    agent_records: int = 0
    kernels_joined: int = 0
    kernels_unmatched: int = 0
    launches_unmatched: int = 0
    rejected: int = 0
    extra: dict[str, int] = field(default_factory=dict)

    def as_dict(self) -> dict[str, int]:
        d = {k: v for k, v in self.__dict__.items() if isinstance(v, int)}
        d.update(self.extra)
        return d


class _Entry:
    """A memoized base path: the stacks it was spliced from (kept alive, so their ids stay
    unique), the spliced path, and the launch paths below it ({api: {kernel name: path}}).
    A backward entry is keyed by the node's head too, and its own Python frames (`py`)."""
    __slots__ = ("py", "nat", "ops", "path", "launches", "head")

    def __init__(self, py: tuple, nat: tuple, ops: tuple, path: Path, head: Path | None = None) -> None:
        self.py, self.nat, self.ops, self.path, self.head = py, nat, ops, path, head
        self.launches: dict[str, dict[str, Path]] = {}


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


class Joiner:
    """Owns one process's tree. Feed it events in arrival order; take snapshots from any thread.

    The BPF side gives every event its path; GPU records find their call through the session's
    `GpuJoin` (daemon/join/gpujoin.py: `LaunchOrderJoin`, or `ApiRecordJoin` with `api_records`),
    which hands its verdicts back through the `Charges` methods below (`kernel`, `copy`, …);
    JAX kernels are split over their operators by a `JaxIndex` (daemon/join/jaxjoin.py)."""

    def __init__(
        self,
        pid: int,
        *,
        agent: bool = False,
        max_nodes: int = 100_000,
        bucket_s: float = 1.0,
        horizon_s: float = 120.0,
        clock=time.monotonic,
        join: JoinKind = JoinKind.API_RECORDS,
        thread_name: Callable[[int], str] | None = None,
    ) -> None:
        """`thread_name(tid)`: the thread's name ("" if unknown), asked once per thread."""
        self.pid = pid
        self.agent = agent
        self._clock = clock
        # the session's JoinKind (inject/channel/gpu.pick_join); without the agent there are no
        # kernel records, and the API-record join has nothing to wait for
        self.gpu_join: GpuJoin = (LaunchOrderJoin(self, clock) if (agent and join is JoinKind.ORDER)
                                  else ApiRecordJoin(self, clock))
        self._copy_frames: dict[tuple[str, str], Frame] = {}
        self._memset_units: dict[str, int] = {}
        self.tree = WindowedCCT(
            metrics=DAEMON_METRICS, bucket_s=bucket_s, horizon_s=horizon_s, max_nodes=max_nodes, clock=clock
        )
        self.stats = JoinStats()
        self.meta: dict[str, Any] = {"pid": pid, "partial": dict(PARTIAL)}
        # GPU time is measured only while the agent's GPU collector runs (CUPTI/RocTracer active)
        self.gpu_collector_active = False
        self._splice_memo: dict[tuple[int, int, int], _Entry] = {}
        self._backward_memo: dict[tuple[int, int, int, int], _Entry] = {}
        self.backward = BackwardLink(splice)   # autograd nodes → their forward context
        # id(launching path) -> its charge memo; an entry keeps its path alive, so ids stay unique
        self._charge_memo: dict[int, _LaunchCharges] = {}
        t = self.tree
        self._i_launch = t.metric_index("launch_count")
        self._i_gpu = t.metric_index("gpu_time_ns")
        self._i_kernels = t.metric_index("kernel_count")
        self.jax: JaxIndex | None = None   # once the agent sends JAX records
        self._thread_name = thread_name
        self._thread_names: dict[int, str] = {}
        self._handle_names: dict[str, str] = {}  # "unresolved:0x…" (a CUfunction) → CUPTI's kernel name
        # per thread, its last launch (CLOCK_MONOTONIC ns, charged path): what `stacklens dump`
        # shows as the GPU work a thread queued last; one dict store per launch
        self.last_launch: dict[int, tuple[int, Path]] = {}
        j = self.gpu_join
        self._on_launch = j.on_launch if agent else None   # without an agent no GPU record comes
        self._on_record: dict[type, Callable[[Any], None]] = {
            KernelRecord: j.on_kernel, MemcpyRecord: self._on_copy_record, ApiRecord: j.on_api,
            PySample: self._on_py_sample, AgentStats: self._on_agent_stats, Note: self._on_note,
            HloMapRecord: self._on_jax_record, CompileRecord: self._on_jax_record,
            InductorRecord: self._on_inductor,
        }
        self.compiled: InductorIndex | None = None   # once the agent sends torch.compile's modules
        # CUDA-graph replays split per node (daemon/join/graphs.py)
        self.graphs = GraphSplit(_demangle, lambda: self.compiled)

    # ---- BPF side -------------------------------------------------------------------------
    def on_bpf(self, ev: Event) -> None:
        stats = self.stats
        stats.events += 1
        kind = ev.kind
        if kind == "launch" or kind == "graph":
            stats.launches += 1
            py, nat, ops = ev.py_stack, ev.native_stack, ev.op_path
            if getattr(ev, "bwd_node", 0):
                m = self._base_entry(ev)
            else:
                key = (id(py), id(nat), id(ops))
                m = self._splice_memo.get(key)  # _base_entry's lookup, inline
                if m is None or m.py is not py or m.nat is not nat or m.ops is not ops:
                    m = self._new_base_entry(ev, key)
            name = getattr(ev, "kernel_name", "") or ""
            if name.startswith("unresolved:"):  # CUPTI named this handle before: use the name
                name = self._handle_names.get(name, name)
            api = ev.api
            by_name = m.launches.get(api)
            path = None if by_name is None else by_name.get(name)
            if path is None:
                path = self._suffixed(m, api, name)
            self.tree.stage(path, self._i_launch, 1)
            if len(self.last_launch) < THREAD_NAMES_MAX or ev.tid in self.last_launch:
                self.last_launch[ev.tid] = (ev.ktime_ns, path)
            if self.graphs.open and self.graphs.on_launch(ev.tid, path):
                return          # captured into a graph: no kernel runs now, its node replays later
            if self._on_launch is not None:
                self._on_launch(ev, path)
            return
        base = self._base_entry(ev).path
        add = self.tree.add_many
        if kind == "cpu_sample":
            stats.cpu_samples += 1
            tid = ev.tid
            if tid not in self._thread_names:
                self._name_thread(tid)
            self.tree.add_sample(base, "cpu_samples", tid)
            return
        api = Frame.api(ev.api)
        if kind == "sync":
            add(base + (api,), {"sync_wait_ns": ev.duration_ns})  # a wait, not API time: once, here
        elif kind == "collective":              # waiting for a torch.distributed collective
            add(base + (api,), {"collective_wait_ns": ev.duration_ns})
        elif kind == "memcpy":                  # copies and memsets (probes.toml: direction "memset")
            self._on_copy_call(ev, base + (api,))
        elif kind == "alloc":
            add(base + (api,), {"alloc_bytes": ev.bytes, "api_cpu_ns": getattr(ev, "duration_ns", 0)})
        elif kind == "free":
            add(base + (api,), {"api_cpu_ns": getattr(ev, "duration_ns", 0)})
        elif kind == "capture":                 # a stream capture begins or ends on this thread
            self.graphs.on_capture(ev.tid, "BeginCapture" in ev.api)
        elif kind == "op_counts":
            pass  # aggregated op entry counts are reported through stats only
        elif kind == "autograd_node":
            self.backward.on_node(ev)
        elif kind == "autograd_eval":
            self.backward.on_eval(ev)
        else:
            stats.rejected += 1

    @staticmethod
    def _suffixed(m: _Entry, api: str, name: str) -> Path:
        """base + api:… (+ kernel:…), built once per (base, api, name): the same tuple after."""
        by_name = m.launches.setdefault(api, {})
        path = m.path + (Frame.api(api), Frame.kernel(name)) if name else m.path + (Frame.api(api),)
        if len(by_name) >= 4096:
            by_name.clear()
        by_name[name] = path
        return path

    def thread_names(self) -> dict[int, str]:
        """tid → name of the threads seen so far ("" where none was read)."""
        return dict(self._thread_names)

    def context_of(self, ev: Event) -> Path:
        """The path an event of this kind would be charged under, charging nothing: a call
        still in progress (`stacklens dump`)."""
        return self._base_entry(ev).path + (Frame.api(ev.api),)

    def _base_entry(self, ev: Event) -> _Entry:
        """The memo entry of the event's stacks (`_Entry`: their splice() and launch paths),
        memoized on the identity of its parts: the probe session hands out the same tuples for
        the same stack ids, so most events are one lookup (on_bpf does that lookup inline).
        An event under an autograd node (`bwd_node`) gets the node's head (daemon/join/backward.py)
        in place of its Python frames."""
        py, nat, ops = ev.py_stack, ev.native_stack, ev.op_path
        node = getattr(ev, "bwd_node", 0)
        if node:
            h = self.backward.head(ev.tid, node)
            if h is not None:
                return self._backward_entry(ev, *h)
        key = (id(py), id(nat), id(ops))
        m = self._splice_memo.get(key)
        if m is not None and m.py is py and m.nat is nat and m.ops is ops:
            return m
        return self._new_base_entry(ev, key)

    def _backward_entry(self, ev: Event, head: Path, linked: bool) -> _Entry:
        """The memo entry of a backward event: head (forward context → backward:NODE) + the
        node's own operators and native frames below the engine's evaluate_function. An
        unlinked node's head follows the thread's own Python frames (where backward() ran)."""
        py, nat, ops = ev.py_stack, ev.native_stack, ev.op_path
        # keyed by the thread's own Python stack even where the path drops it: the caller view's table
        key = (id(head), id(py), id(nat), id(ops))
        m = self._backward_memo.get(key)
        if m is not None and m.head is head and m.nat is nat and m.ops is ops and m.py is py:
            return m
        # a compiled backward's wrapper line: its model lines follow the head (daemon/join/compiled.py)
        tail = self.compiled.tail(py) if linked and self.compiled is not None else None
        own = splice(tuple(py), tuple(getattr(ev, "py_entries", ()) or ()), (), ()) if py and tail is None else ()
        if own and self.compiled is not None:
            own = self.compiled.rewrite(own)
        if linked:
            if tail is None:
                self.backward.note_caller(head, own)   # where backward() ran: the caller view
            own = ()
        native = tuple(nat)
        below = next((i for i in range(len(native) - 1, -1, -1) if "evaluate_function" in native[i].name), -1)
        path = own + head + (tail or ()) + splice((), (), tuple(ops), native[below + 1:] if below >= 0 else native)
        if len(self._backward_memo) >= 65_536:
            self._backward_memo.clear()
        m = self._backward_memo[key] = _Entry(py, nat, ops, path, head)
        return m

    def _new_base_entry(self, ev: Event, key: tuple[int, int, int]) -> _Entry:
        """A memo miss: splice the event's stacks and remember them under `key` (their ids)."""
        py, nat, ops = ev.py_stack, ev.native_stack, ev.op_path
        path = splice(tuple(py), tuple(getattr(ev, "py_entries", ()) or ()), tuple(ops), tuple(nat))
        if self.compiled is not None:
            path = self.compiled.rewrite(path)
        if len(self._splice_memo) >= 65_536:
            self._splice_memo.clear()
        m = self._splice_memo[key] = _Entry(py, nat, ops, path)  # keeps the parts alive: ids stay unique
        return m

    # ---- agent side -----------------------------------------------------------------------
    def on_agent(self, rec: AgentRecord) -> None:
        self.stats.agent_records += 1
        handle = self._on_record.get(type(rec))
        if handle is not None:                  # AgentHello, SyncRecord: nothing to join
            handle(rec)

    def _on_py_sample(self, rec: PySample) -> None:
        frames = sample_frames(rec.frames)
        if self.compiled is not None:
            frames = self.compiled.rewrite(frames)
        if frames:
            if rec.tid not in self._thread_names:
                self._name_thread(rec.tid)
            self.tree.add_sample(frames, "py_samples", rec.tid)

    def _name_thread(self, tid: int) -> None:
        if tid > 0 and len(self._thread_names) < THREAD_NAMES_MAX:
            self._thread_names[tid] = self._thread_name(tid) if self._thread_name is not None else ""

    def _on_agent_stats(self, rec: AgentStats) -> None:
        self.gpu_collector_active = bool(rec.gpu.get("active")) or self.gpu_collector_active
        ex = self.stats.extra           # the agent's own view, latest report (stats, /metrics)
        ex["agent_samples"] = _agent_gauge(rec.samples)
        ex["agent_sample_hz"] = _agent_gauge(rec.sample_hz)
        ex["agent_sample_cost_us"] = _agent_gauge(rec.sample_cost_us)
        for k in AGENT_DROP_KINDS:        # known names only: the keys come from the target
            v = rec.dropped.get(k)
            if isinstance(v, int) and not isinstance(v, bool):
                ex[f"agent_dropped_{k}"] = _agent_gauge(v)
        if rec.gpu.get("enabled_at_ns"):
            self.gpu_join.on_enabled(rec.gpu["enabled_at_ns"])

    def _on_note(self, rec: Note) -> None:
        notes = self.meta.setdefault("notes", [])
        if len(notes) < 32:
            notes.append(f"agent {rec.level}: {rec.message}"[:300])

    def _on_jax_record(self, rec: HloMapRecord | CompileRecord) -> None:
        """A JAX record goes to the splitter (created on first use, its rule added to the notes);
        a compile event comes back as a charge at its call site."""
        if self.jax is None:
            self.jax = JaxIndex()
            notes = self.meta.setdefault("notes", [])
            if SPLIT_NOTE not in notes:
                notes.append(SPLIT_NOTE)
        for c in self.jax.on_record(rec):
            self.tree.add_many(c.path, c.metrics)
        self.meta["jax"] = self.jax.meta()

    def _on_inductor(self, rec: InductorRecord) -> None:
        """A part of a torch.compile wrapper module's map; once complete, paths spliced before
        are spliced again (the memos cleared) so they go through it."""
        if self.compiled is None:
            self.compiled = InductorIndex()
            notes = self.meta.setdefault("notes", [])
            if COMPILED_NOTE not in notes:
                notes.append(COMPILED_NOTE)
        if self.compiled.add(rec):
            self._splice_memo.clear()
            self._backward_memo.clear()
            self.graphs.forget_unknown()
        self.meta["inductor"] = self.compiled.meta()

    # ---- Charges: what the GpuJoin decided ---------------------------------------------------
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
                    self._graph_charges(self.graphs.kernel(path, rec))
                    return
                d = rec.end_ns - rec.start_ns
                self.tree.stage_pair(p, self._i_gpu, d if d > 0 else 0, self._i_kernels, 1)
                return
            e = self._charge_memo.get(id(path))
            if e is not None:
                hit = e.by_name.get(rec.name)
                if hit is not None:
                    if hit.handle is not None and len(self._handle_names) < HANDLE_NAMES_MAX and not rec.graph_id:
                        self._handle_names[hit.handle] = hit.kname
                    d = rec.end_ns - rec.start_ns
                    self.tree.stage_pair(hit.path, self._i_gpu, d if d > 0 else 0, self._i_kernels, 1)
                    return
        self._charge_new(path, rec)

    def _graph_charges(self, charges) -> None:
        if not charges:
            return
        if "graphs" not in self.meta:
            notes = self.meta.setdefault("notes", [])
            if GRAPH_NOTE not in notes:
                notes.append(GRAPH_NOTE)
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
        # libstdc++'s demangler through ctypes: loaded at the first kernel, so the join imports pure
        from stacklens.introspect.demangle import demangle

        kname = demangle(krec.name)
        charged, handle = path, None
        if path[-1].kind != "kernel":
            charged = path + (Frame.kernel(kname),)
        elif path[-1].name != kname and path[-1].name.startswith("unresolved:"):
            # the handle's name, learnt from CUPTI: later launches of it land on the named node
            handle = path[-1].name
            if len(self._handle_names) < HANDLE_NAMES_MAX and not krec.graph_id:
                self._handle_names[handle] = kname
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
                if len(memo) >= 65_536:
                    memo.clear()
                e = memo[id(path)] = _LaunchCharges(path)
            if len(e.by_name) < 1024:
                e.by_name[krec.name] = _Charged(charged, handle, kname)
        d = krec.end_ns - krec.start_ns
        self.tree.stage_pair(charged, self._i_gpu, d if d > 0 else 0, self._i_kernels, 1)

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

    def _memset_unit(self, api: str) -> int:
        """Bytes per element of a memset call (cuMemsetD32Async: 4); 1 for byte counts."""
        u = self._memset_units.get(api)
        if u is None:
            m = _MEMSET_UNIT.search(api)
            u = int(m.group(1)) // 8 if m else 1
            if len(self._memset_units) < 4096:
                self._memset_units[api] = u
        return u

    def _on_copy_call(self, ev: Event, path: Path) -> None:
        memset = getattr(ev, "direction", "") == "memset"
        nbytes = ev.bytes * self._memset_unit(ev.api) if memset else ev.bytes
        if not self.agent:
            self.tree.add_many(path, {"memset_bytes" if memset else "copy_bytes": nbytes,
                                      "api_cpu_ns": getattr(ev, "duration_ns", 0)})
            return
        self.tree.add_many(path, {"api_cpu_ns": getattr(ev, "duration_ns", 0)})
        self.gpu_join.on_copy_call(ev, CopyCall(ev.ktime_ns, path, nbytes, "memset" if memset else "memcpy"))

    def _on_copy_record(self, rec: MemcpyRecord) -> None:
        self.gpu_collector_active = True
        self.gpu_join.on_copy(rec)

    def copy_dropped(self, call: CopyCall) -> None:
        self.tree.add_many(call.path, {call.metric: call.nbytes})
        ex = self.stats.extra
        ex["copy_calls_unmatched"] = ex.get("copy_calls_unmatched", 0) + 1

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

    # ---- time ------------------------------------------------------------------------------
    def flush(self) -> None:
        """End of a batch: apply the staged launch/kernel counts to the tree (see the module
        docstring). Snapshots, `expire()` and `finish()` flush by themselves."""
        self.tree.flush()

    def finish(self) -> None:
        """At detach: join what is still waiting (the order join's unsettled kernel groups, the
        copies and memsets)."""
        self.gpu_join.finish()
        self._graph_charges(self.graphs.flush())
        self.stats.extra.update(self.gpu_join.stats())
        self.tree.flush()

    def settle(self) -> None:
        """A window's edge, once the agent's flush is in: every GPU record received is joined."""
        self.gpu_join.settle()
        self._graph_charges(self.graphs.flush())
        self.stats.extra.update(self.gpu_join.stats())
        self.tree.flush()

    def expire(self, now_ns: int) -> None:
        self.gpu_join.expire(now_ns)
        if self.graphs.waiting():
            self._graph_charges(self.graphs.flush())
        self.stats.extra.update(self.gpu_join.stats())
        if self.backward.stats:
            self.stats.extra.update(self.backward.stats)
            self.stats.extra.update(self.backward.sizes())
        self.tree.flush()

    def waiting_launches(self) -> int:
        """Launches still waiting for their GPU record (a window's `unjoined`, after `finish`)."""
        return self.gpu_join.waiting_launches()

    # ---- reading --------------------------------------------------------------------------
    def unavailable(self) -> set[str]:
        out = set()
        if not self.agent:
            out.add("py_samples")
        if not (self.agent and self.gpu_collector_active):
            out.update(GPU_MEASURED)  # no agent, or an agent without a GPU collector (CPU job)
        if self.jax is None or not self.jax.stats["compile_events"]:
            out.add("compile_time_ns")  # measured only for JAX targets (jax.monitoring)
        if "rank" not in self.meta:
            out.add("collective_wait_ns")  # probed in torch.distributed ranks only (bpf/attach.py)
        return out

    def snapshot(self, window_s: float | None = None) -> Snapshot:
        meta = dict(self.meta)
        named = {str(tid): name for tid, name in self._thread_names.items() if name}
        if named:                 # tid -> name, pprof's thread labels
            meta["threads"] = named
        if self.backward.stats:   # how much backward work found its forward context
            meta["backward_link"] = dict(self.backward.stats)
            callers = self.backward.callers_meta()
            if callers:           # linked heads' callers: the caller view (cct/backwardview.py)
                meta["backward_callers"] = callers
        snap = self.tree.snapshot(window_s=window_s, meta=meta, unavailable=self.unavailable())
        return name_launches(snap, self._handle_names)   # launches before a kernel was named (rename.py)
