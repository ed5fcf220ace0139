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
  CUPTI API records (`ApiRecordJoin`, daemon/join/apijoin.py) — and `GpuCharges`
  (daemon/join/charges.py) charges `gpu_time_ns` and `kernel_count` to that launching path. What
  cannot be joined is counted, never guessed.
  Launches counted on `kernel:unresolved:0x…` before CUPTI named the handle: renamed in snapshots (rename.py).
- Copies and memsets: `… → api:cuMemcpyAsync → memcpy:DtoH (Device -> Pinned)` / `… →
  memset:Device` with GPU time, bytes and counts from CUPTI (see `GpuCharges.copy_call`,
  daemon/join/charges.py), joined by the same `GpuJoin`.
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

import time
from typing import TYPE_CHECKING, Any, Callable

from stacklens.cct import Frame, Snapshot, WindowedCCT, metrics
from stacklens.daemon.join.apijoin import ApiRecordJoin
from stacklens.daemon.join.backward import BackwardLink
from stacklens.daemon.join.charges import GpuCharges
from stacklens.daemon.join.compiled import COMPILED_NOTE, InductorIndex
from stacklens.daemon.join.gpujoin import GpuJoin, Path
from stacklens.daemon.join.graphs import GraphSplit
from stacklens.daemon.join.orderjoin import LaunchOrderJoin
from stacklens.daemon.join.paths import EventPaths
from stacklens.daemon.join.rename import name_launches
from stacklens.daemon.join.splice import splice
from stacklens.daemon.join.stats import JoinStats, add_note
from stacklens.records.agent import (AgentRecord, AgentStats, ApiRecord, CompileRecord, HloMapRecord, InductorRecord,
                                      JoinKind, KernelRecord, MemcpyRecord, Note, PySample)

if TYPE_CHECKING:
    from stacklens.records.events import Event

# Every metric of the registry (cct/metrics.py); py_samples (the in-process sampler) is kept apart
# from the BPF cpu_samples so neither is double counted.
DAEMON_METRICS = metrics.ALL
GPU_MEASURED = tuple(m.name for m in metrics.REGISTRY if m.needs == "gpu")  # unavailable without it

THREAD_NAMES_MAX = 4096   # threads named per process; later ones keep their tid only


def _demangle(name: str) -> str:
    # libstdc++'s demangler through ctypes: loaded at the first kernel, so the join imports pure
    from stacklens.introspect.demangle import demangle
    return demangle(name)


# metrics a live profile measures only in part: what each lacks (snapshot meta["partial"])
PARTIAL = {"api_cpu_ns": "kernel launch API time is not measured: launch probes are entry-only (a return "
                         "probe costs more than a launch); api_cpu_ns holds allocations, frees and "
                         "synchronous copies"}


class Joiner:
    """Owns one process's tree. Feed it events in arrival order; take snapshots from any thread.

    The BPF side gives every event its path (`EventPaths`, daemon/join/paths.py); GPU records find
    their call through the session's `GpuJoin` (daemon/join/gpujoin.py: `LaunchOrderJoin`, or
    `ApiRecordJoin` with `api_records`), which hands its verdicts back through the `Charges`
    methods below (`kernel`, `copy`, …), charged by `GpuCharges` (daemon/join/charges.py; JAX
    kernels split over their operators there by a `JaxIndex`, daemon/join/jaxjoin.py). The Joiner
    routes events and records, keeps the window bookkeeping (flush, expire, settle, finish) and
    reads snapshots."""

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
        self.tree = WindowedCCT(
            metrics=DAEMON_METRICS, bucket_s=bucket_s, horizon_s=horizon_s, max_nodes=max_nodes, clock=clock
        )
        self.stats = JoinStats()
        self.meta: dict[str, Any] = {"pid": pid, "partial": dict(PARTIAL)}
        self._handle_names: dict[str, str] = {}  # "unresolved:0x…" (a CUfunction) → CUPTI's kernel name
        self.backward = BackwardLink(splice)   # autograd nodes → their forward context
        self.paths = EventPaths(self.backward, self._handle_names)
        # CUDA-graph replays split per node (daemon/join/graphs.py)
        self.graphs = GraphSplit(_demangle, lambda: self.compiled)
        self.charges = GpuCharges(self.tree, self.stats, self.meta, self.graphs, agent=agent, demangle=_demangle,
                                  handle_names=self._handle_names)
        # the session's JoinKind (inject/channel/gpu.pick_join); without the agent there are no
        # kernel records, and the API-record join has nothing to wait for
        # the GpuJoin's verdicts go straight to GpuCharges (the `Charges` interface)
        self.gpu_join: GpuJoin = (LaunchOrderJoin(self.charges, clock) if (agent and join is JoinKind.ORDER)
                                  else ApiRecordJoin(self.charges, clock))
        self._i_launch = self.tree.metric_index("launch_count")
        self._thread_name = thread_name
        self._thread_names: dict[int, str] = {}
        # per thread, its last launch (CLOCK_MONOTONIC ns, charged path): what `stacklens dump`
        # shows as the GPU work a thread queued last; one dict store per launch
        self.last_launch: dict[int, tuple[int, Path]] = {}
        j = self.gpu_join
        self._launch_path = self.paths.launch
        self._on_launch = j.on_launch if agent else None   # without an agent no GPU record comes
        self._on_record: dict[type, Callable[[Any], None]] = {
            KernelRecord: j.on_kernel, MemcpyRecord: self._on_copy_record, ApiRecord: j.on_api,
            PySample: self._on_py_sample, AgentStats: self._on_agent_stats, Note: self._on_note,
            HloMapRecord: self.charges.on_jax_record, CompileRecord: self.charges.on_jax_record,
            InductorRecord: self._on_inductor,
        }

    @property
    def compiled(self) -> InductorIndex | None:
        """torch.compile's module map, once the agent sent one (daemon/join/compiled.py)."""
        return self.paths.compiled

    # ---- BPF side -------------------------------------------------------------------------
    def on_bpf(self, ev: Event) -> None:
        stats = self.stats
        stats.events += 1
        kind = ev.kind
        if kind == "launch" or kind == "graph":
            stats.launches += 1
            path = self._launch_path(ev)
            self.tree.stage(path, self._i_launch, 1)
            if len(self.last_launch) < THREAD_NAMES_MAX or ev.tid in self.last_launch:
                self.last_launch[ev.tid] = (ev.ktime_ns, path)
            if self.graphs.open and self.graphs.on_launch(ev.tid, path):
                return          # captured into a graph: no kernel runs now, its node replays later
            if self._on_launch is not None:
                self._on_launch(ev, path)
            return
        base = self.paths.base(ev).path
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
            call = self.charges.copy_call(ev, base + (api,))
            if call is not None:                # with an agent: it waits for its CUPTI record
                self.gpu_join.on_copy_call(ev, call)
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

    def thread_names(self) -> dict[int, str]:
        """tid → name of the threads seen so far ("" where none was read)."""
        return dict(self._thread_names)

    def context_of(self, ev: Event) -> Path:
        """The path an event of this kind would be charged under, charging nothing: a call
        still in progress (`stacklens dump`)."""
        return self.paths.context_of(ev)

    def _name_thread(self, tid: int) -> None:
        if tid > 0 and len(self._thread_names) < THREAD_NAMES_MAX:
            self._thread_names[tid] = self._thread_name(tid) if self._thread_name is not None else ""

    # ---- agent side -----------------------------------------------------------------------
    def on_agent(self, rec: AgentRecord) -> None:
        self.stats.agent_records += 1
        handle = self._on_record.get(type(rec))
        if handle is not None:                  # AgentHello, SyncRecord: nothing to join
            handle(rec)

    def _on_py_sample(self, rec: PySample) -> None:
        frames = self.paths.sample(rec.frames)
        if frames:
            if rec.tid not in self._thread_names:
                self._name_thread(rec.tid)
            self.tree.add_sample(frames, "py_samples", rec.tid)

    def _on_agent_stats(self, rec: AgentStats) -> None:
        c = self.charges
        c.gpu_collector_active = bool(rec.gpu.get("active")) or c.gpu_collector_active
        self.stats.agent_report(rec)    # the agent's own view, latest report (stats, /metrics)
        if rec.gpu.get("enabled_at_ns"):
            self.gpu_join.on_enabled(rec.gpu["enabled_at_ns"])

    def _on_note(self, rec: Note) -> None:
        notes = self.meta.setdefault("notes", [])
        if len(notes) < 32:
            notes.append(f"agent {rec.level}: {rec.message}"[:300])

    def _on_inductor(self, rec: InductorRecord) -> None:
        """A part of a torch.compile wrapper module's map; once complete, paths spliced before
        are spliced again so they go through it, and graph nodes not yet known are looked up again."""
        if self.paths.compiled is None:
            add_note(self.meta, COMPILED_NOTE)
        if self.paths.add_inductor(rec):
            self.graphs.forget_unknown()
        self.meta["inductor"] = self.paths.compiled.meta()

    def _on_copy_record(self, rec: MemcpyRecord) -> None:
        self.charges.gpu_collector_active = True
        self.gpu_join.on_copy(rec)

    # ---- time ------------------------------------------------------------------------------
    def flush(self) -> None:
        """End of a batch: apply the staged launch/kernel counts to the tree (see the module
        docstring). Snapshots, `expire()` and `finish()` flush by themselves."""
        self.tree.flush()

    def finish(self) -> None:
        """At detach: join what is still waiting (the order join's unsettled kernel groups, the
        copies and memsets)."""
        self.gpu_join.finish()
        self.charges.graph_kernels(self.graphs.flush())
        self.stats.extra.update(self.gpu_join.stats())
        self.tree.flush()

    def settle(self) -> None:
        """A window's edge, once the agent's flush is in: every GPU record received is joined."""
        self.gpu_join.settle()
        self.charges.graph_kernels(self.graphs.flush())
        self.stats.extra.update(self.gpu_join.stats())
        self.tree.flush()

    def expire(self, now_ns: int) -> None:
        self.gpu_join.expire(now_ns)
        if self.graphs.waiting():
            self.charges.graph_kernels(self.graphs.flush())
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
        if not (self.agent and self.charges.gpu_collector_active):
            out.update(GPU_MEASURED)  # no agent, or an agent without a GPU collector (CPU job)
        jax = self.charges.jax
        if jax is None or not jax.stats["compile_events"]:
            out.add("compile_time_ns")  # measured only for JAX targets (jax.monitoring)
        if "rank" not in self.meta:
            out.add("collective_wait_ns")  # probed in torch.distributed ranks only (bpf/scan.py)
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
