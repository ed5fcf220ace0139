"""The join: BPF events and agent records of one process folded into its calling context tree.

Runs on the process's aggregation thread only (no locks in here). No privilege.

Paths read  py frames → C extension → op frames → native frames → api:… → kernel:…  (outermost
first; `splice()` puts native frames between Python runs where the eval loop's frames allow).
- CPU samples (BPF perf event): py + ops + native.
- Launches: py + ops + native + api + kernel; `launch_count` at once. GPU time arrives later from
  the agent (CUPTI): the launch's path waits in a per-thread queue until the CUPTI API record of
  the same thread whose [start, end] holds the BPF timestamp (clocks calibrated by the agent to
  CLOCK_MONOTONIC) claims it; the kernel record with that correlation id then charges
  `gpu_time_ns` and `kernel_count` to the exact launching path. Unmatched launches age out and
  are counted, never guessed.
- Copies and memsets: `… → api:cuMemcpyAsync → memcpy:DtoH (Device -> Pinned)` / `… →
  memset:Device` with GPU time, bytes and counts from CUPTI (see `_on_copy_call`).
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

import collections
import functools
import re
import time
from dataclasses import dataclass, field
from typing import Any, Iterable

from stacklens.cct import Frame, Snapshot, WindowedCCT, metrics
from stacklens.daemon.backward import BackwardLink
from stacklens.daemon.orderjoin import OrderJoin, copy_sig, launch_sig, sorted_pos_from_end
from stacklens.introspect.demangle import demangle
from stacklens.inject.records import MemcpyRecord

# Every metric of the registry (cct/metrics.py); py_samples (the in-process sampler) is kept apart
# from the BPF cpu_samples so neither is double counted.
DAEMON_METRICS = metrics.ALL
GPU_MEASURED = tuple(m.name for m in metrics.REGISTRY if m.needs == "gpu")  # unavailable without it

# The interpreter's files as the Symbolizer names native frames (the mapped file's basename):
# a shared libpython ("libpython3.12.so.1.0", "libpython3.13t.so.1.0") or a statically linked
# executable ("python3.12", "python3": Debian/Ubuntu system Pythons; "python"). A full path is
# taken by its basename.
_INTERPRETER_FILE = re.compile(r"^(lib)?python(3(\.\d+)?[a-z]*)?(\.so(\.[\d.]*)?)?$")
MAX_NATIVE_FRAMES = 16
PENDING_MAX_AGE_NS = 30_000_000_000
# The uprobe fires at the launch function's first instruction, CUPTI stamps the API record a little
# later, and the clock calibration is good to about a microsecond: a launch belongs to the API
# record of its thread whose [start - EARLY, end + SLACK] holds its BPF time.
CLAIM_SLACK_NS = 2_000
CLAIM_EARLY_NS = 1_000_000
PENDING_MAX_PER_THREAD = 65_536
HANDLE_NAMES_MAX = 65_536
_UNSEEN = (Frame.other("[launch not seen]"),)  # one tuple: its charges are staged together
# GPU copies and memsets (CUPTI MEMCPY / MEMSET activity), see `_on_copy_call`
_COPY_UNSEEN = (Frame.other("[copy call not seen]"),)
COPY_WAIT_MAX_NS = 10_000_000_000   # exact join: a copy record waits this long for its API record
_MEMSET_UNIT = re.compile(r"MemsetD(8|16|32)")


def trim_native(frames: Iterable[Frame]) -> tuple[Frame, ...]:
    """Native frames below the interpreter, leaf-most MAX_NATIVE_FRAMES of them.

    Frames of the interpreter itself (and everything above it: _start, Py_RunMain …) are what the
    Python frames already say; a truncated marker is kept so a cut stack is never hidden.
    """
    out: list[Frame] = []
    for f in reversed(tuple(frames)):  # leaf first
        if _is_interp(f):
            break
        out.append(f)
        if len(out) >= MAX_NATIVE_FRAMES:
            out.append(Frame.other("[truncated]"))
            break
    out.reverse()
    return tuple(out)


EVAL_LOOP = "_PyEval_EvalFrameDefault"
_OP_LIBS = ("libtorch_cpu", "libtorch_cuda", "libtorch_hip")


def _is_eval(f: Frame) -> bool:
    return f.kind == "native" and (f.name == EVAL_LOOP or f.name.startswith(EVAL_LOOP + "."))


@functools.lru_cache(maxsize=1024)
def _is_interp_file(file: str) -> bool:
    # a mapping whose file was replaced while the process runs (an upgrade) is named "... (deleted)"
    return _INTERPRETER_FILE.match(file.rpartition("/")[2].removesuffix(" (deleted)")) is not None


def _is_interp(f: Frame) -> bool:
    return f.kind == "native" and _is_interp_file(f.file)


def _between_runs(seg: tuple[Frame, ...]) -> list[Frame]:
    """The native frames between two eval-loop frames that go between the two Python runs: not
    the interpreter's own frames, nor an `other` frame (`[anon]`, `[vdso]`) inside the
    interpreter's region — one whose nearest non-`other` neighbours on both sides are the
    interpreter's (the bounding eval frames count): under `python -X perf` (CPython 3.12+) each
    eval-loop invocation is entered through a perf trampoline in anonymous memory, an `[anon]`
    frame between the eval frames that the Python frames already stand for. JIT code a C
    function calls (a non-interpreter frame on either side) stays."""
    out: list[Frame] = []
    for i, f in enumerate(seg):
        if _is_interp(f):
            continue
        if f.kind == "other":
            up = next((g for g in reversed(seg[:i]) if g.kind != "other"), None)   # None: the eval frame
            down = next((g for g in seg[i + 1:] if g.kind != "other"), None)
            if (up is None or _is_interp(up)) and (down is None or _is_interp(down)):
                continue
        out.append(f)
    return out


def _is_op_entry(f: Frame) -> bool:
    return f.kind == "native" and f.name.startswith("at::_ops::")


def splice(py: tuple[Frame, ...], entries: tuple[bool, ...], ops: tuple[str, ...],
           native: tuple[Frame, ...]) -> tuple[Frame, ...]:
    """One path, outermost first: Python → C extension → operators → native leaf.

    py/entries: the event's Python frames and, aligned with them, True where one eval-loop
    invocation begins (`Event.py_entries`). native: the unwound native stack, outermost first.
    - Below the interpreter: the native frames under the innermost interpreter frame (the C
      extension the Python code called, e.g. libtorch_python.so, then the operator's library).
      Operator frames (from the shadow stack) go right above the first `at::_ops::…` or
      libtorch_cpu frame (after the extension frames); without one, above all of them. Leaf-most MAX_NATIVE_FRAMES
      kept, a cut marked — the contract of `trim_native`.
    - Between Python runs: when the native stack holds exactly one `_PyEval_EvalFrameDefault`
      (incl. `.cold`) frame per run (run k = Python frames from the k-th entry frame on), the
      non-interpreter native frames between two eval frames (a C function calling back into
      Python: qsort, ctypes callbacks, torch autograd hooks) go between the two runs; `[anon]`
      frames among the interpreter's (perf trampolines under `python -X perf`) do not
      (`_between_runs`). Otherwise (unwind cut, no markers on 3.10, count mismatch) the Python
      frames sit above, unspliced. The leaf part is kept as unwound: a sample in the vDSO
      (clock_gettime) or in JIT code ends in its `[vdso]` / `[anon]` frame.
    Interpreter frames: those of a shared libpython3.x or of a statically linked python3.x
    executable (`_is_interp`).
    """
    native = tuple(native)
    op_frames = tuple(Frame.op(o) for o in ops)
    # index just below the innermost interpreter frame (0 if the unwind never reached one)
    cut = 0
    for i in range(len(native) - 1, -1, -1):
        if _is_interp(native[i]):
            cut = i + 1
            break
    below = native[cut:]
    j = next((i for i, f in enumerate(below) if _is_op_entry(f) or f.file.startswith(_OP_LIBS)), 0)
    ext, rest = below[:j], below[j:]
    if ext and all(f.kind == "other" for f in ext):
        ext, rest = (), ext + rest  # only a cut marker above the op library: it belongs to the leaf part
    if len(rest) > MAX_NATIVE_FRAMES:
        rest = (Frame.other("[truncated]"),) + rest[-MAX_NATIVE_FRAMES:]
    if len(ext) > MAX_NATIVE_FRAMES:
        ext = (Frame.other("[truncated]"),) + ext[-MAX_NATIVE_FRAMES:]
    head = tuple(py)
    starts = [i for i, e in enumerate(entries) if e] if len(entries) == len(py) else []
    if len(starts) > 1:
        evals = [i for i, f in enumerate(native[:cut]) if _is_eval(f)]
        if len(evals) == len(starts):
            out: list[Frame] = list(py[:starts[0]])
            for k, s in enumerate(starts):
                end = starts[k + 1] if k + 1 < len(starts) else len(py)
                out.extend(py[s:end])
                if k + 1 < len(evals):
                    out.extend(_between_runs(native[evals[k] + 1:evals[k + 1]]))
            head = tuple(out)
    return head + ext + op_frames + rest


@dataclass
class _Pending:
    ktime_ns: int
    path: tuple[Frame, ...]


def _ktime_of(p: _Pending) -> int:
    return p.ktime_ns


class _CopyCall:
    """A BPF copy or memset call waiting for its CUPTI record: the call's path (… → api:…) and
    what the call itself said it moves (`nbytes` of `metric`), charged only if no record claims
    it (`Joiner._copy_dropped`), so every byte is counted once."""
    __slots__ = ("ktime_ns", "path", "nbytes", "metric")

    def __init__(self, ktime_ns: int, path: tuple[Frame, ...], nbytes: int, metric: str) -> None:
        self.ktime_ns, self.path, self.nbytes, self.metric = ktime_ns, path, nbytes, metric


def is_copy_api(name: str) -> bool:
    """A CUPTI API record of a copy or memset call (cudaMemcpyAsync, cuMemsetD32Async …), not a
    graph-building one (cudaGraphAddMemcpyNode): the agent keeps the same cbids."""
    return ("Memcpy" in name or "Memset" in name) and "Graph" not in name


AGENT_DROP_KINDS = ("samples", "gpu", "gpu_buffers", "messages", "jax")
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


def _claim_from(q, last_claims: dict, api: Any, dropped) -> Any:
    """The pending call (of queue `q`, sorted by time) that CUPTI API record `api` claims: the
    last one that entered before the record ended, if it entered no earlier than CLAIM_EARLY_NS
    before its start; the calls before it were never reported (`dropped` gets each). Else the
    thread's last claim, when it lies inside the record (a runtime record around its driver
    record). None when nothing fits."""
    hi = api.end_ns + CLAIM_SLACK_NS
    n = 0
    if q:
        while n < len(q) and q[n].ktime_ns <= hi:
            n += 1
    if n and q[n - 1].ktime_ns >= api.start_ns - CLAIM_EARLY_NS:
        for _ in range(n - 1):
            dropped(q.popleft())
        claim = last_claims[api.tid] = q.popleft()
        return claim
    last = last_claims.get(api.tid)
    if last is not None and api.start_ns - CLAIM_EARLY_NS <= last.ktime_ns <= hi:
        return last
    return None


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


class Joiner:
    """Owns one process's tree. Feed it events in arrival order; take snapshots from any thread."""

    def __init__(
        self,
        pid: int,
        *,
        agent: bool = False,
        max_nodes: int = 100_000,
        bucket_s: float = 1.0,
        horizon_s: float = 120.0,
        clock=time.monotonic,
        api_records: bool = True,
    ) -> None:
        self.pid = pid
        self.agent = agent
        self._clock = clock
        # without CUPTI API records (agent config gpu_api_records=False) kernels join by launch order
        self.order = OrderJoin() if (agent and not api_records) else None
        # copies and memsets: their own queue of calls (the records claim calls, never launches)
        self.copy_order = OrderJoin(copy_sig, self._copy_dropped) if self.order is not None else None
        self._pending_copies: dict[int, collections.deque[_CopyCall]] = collections.defaultdict(collections.deque)
        self._last_copy_claim: dict[int, _CopyCall] = {}
        self._copy_by_corr: collections.OrderedDict[int, _CopyCall] = collections.OrderedDict()
        self._copies_waiting: dict[int, list] = {}     # correlation id -> [arrival ns, [records]]
        self._copy_frames: dict[tuple[str, str], Frame] = {}
        self._memset_units: dict[str, int] = {}
        self.tree = WindowedCCT(
            metrics=DAEMON_METRICS, bucket_s=bucket_s, horizon_s=horizon_s, max_nodes=max_nodes, clock=clock
        )
        self.stats = JoinStats()
        self.meta: dict[str, Any] = {"pid": pid, "partial": dict(PARTIAL)}
        self._pending: dict[int, collections.deque[_Pending]] = collections.defaultdict(collections.deque)
        # correlation id → launching path; kept (bounded) because a graph launch has many kernels
        self._by_correlation: collections.OrderedDict[int, tuple[Frame, ...]] = collections.OrderedDict()
        self._last_claim: dict[int, _Pending] = {}
        self._kernels_waiting: dict[int, list[Any]] = {}
        # GPU time is measured only while the agent's GPU collector runs (CUPTI/RocTracer active)
        self.gpu_collector_active = False
        self._splice_memo: dict[tuple[int, int, int], list] = {}
        self._backward_memo: dict[tuple[int, int, int, int], list] = {}
        self.backward = BackwardLink(splice)   # autograd nodes → their forward context
        # memoized full paths: {api: {kernel name: launch path}} in each splice memo entry, and
        # id(launching path) -> (launching path, {CUPTI kernel name: (charged path, unresolved
        # handle or None, demangled name)}); an entry keeps its path alive, so ids stay unique
        self._charge_memo: dict[int, tuple] = {}
        t = self.tree
        self._i_launch = t.metric_index("launch_count")
        self._i_gpu = t.metric_index("gpu_time_ns")
        self._i_kernels = t.metric_index("kernel_count")
        self.jax = None  # daemon.jaxjoin.JaxIndex once the agent sends JAX records
        self._handle_names: dict[str, str] = {}  # "unresolved:0x…" (a CUfunction) → CUPTI's kernel name

    # ---- BPF side -------------------------------------------------------------------------
    def on_bpf(self, ev: Any) -> None:
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
                if m is None or m[0] is not py or m[1] is not nat or m[2] is not ops:
                    m = self._new_base_entry(ev, key)
            name = getattr(ev, "kernel_name", "") or ""
            if name.startswith("unresolved:"):  # CUPTI named this handle before: use the name
                name = self._handle_names.get(name, name)
            api = ev.api
            by_name = m[4].get(api)
            path = None if by_name is None else by_name.get(name)
            if path is None:
                path = self._suffixed(m, api, name)
            self.tree.stage(path, self._i_launch, 1)
            if self.order is not None:
                self.order.on_launch(ev.ktime_ns, path,
                                     launch_sig(getattr(ev, "args", None)) if kind == "launch" else None)
            elif self.agent:
                q = self._pending[ev.tid]
                if q and ev.ktime_ns < q[-1].ktime_ns:  # out of order: keep the queue sorted (after equal times)
                    q.insert(sorted_pos_from_end(q, ev.ktime_ns, _ktime_of), _Pending(ev.ktime_ns, path))
                else:
                    q.append(_Pending(ev.ktime_ns, path))
                if len(q) > PENDING_MAX_PER_THREAD:
                    q.popleft()
                    stats.launches_unmatched += 1
            return
        base = self._base_entry(ev)[3]
        add = self.tree.add_many
        if kind == "cpu_sample":
            stats.cpu_samples += 1
            add(base, {"cpu_samples": 1})
            return
        api = Frame.api(ev.api)
        if kind == "sync":
            add(base + (api,), {"sync_wait_ns": ev.duration_ns})  # a wait, not API time: once, here
        elif kind == "memcpy":                  # copies and memsets (probes.toml: direction "memset")
            self._on_copy_call(ev, base + (api,))
        elif kind == "alloc":
            add(base + (api,), {"alloc_bytes": ev.bytes, "api_cpu_ns": getattr(ev, "duration_ns", 0)})
        elif kind == "free":
            add(base + (api,), {"api_cpu_ns": getattr(ev, "duration_ns", 0)})
        elif kind == "op_counts":
            pass  # aggregated op entry counts are reported through stats only
        elif kind == "autograd_node":
            self.backward.on_node(ev)
        elif kind == "autograd_eval":
            self.backward.on_eval(ev)
        else:
            stats.rejected += 1

    @staticmethod
    def _suffixed(m: list, api: str, name: str) -> tuple[Frame, ...]:
        """base + api:… (+ kernel:…), built once per (base, api, name): the same tuple after."""
        by_name = m[4].setdefault(api, {})
        path = m[3] + (Frame.api(api), Frame.kernel(name)) if name else m[3] + (Frame.api(api),)
        if len(by_name) >= 4096:
            by_name.clear()
        by_name[name] = path
        return path

    def _base_entry(self, ev: Any) -> list:
        """[py, nat, ops, splice() of the event's stacks, {api: {kernel name: launch path}}],
        memoized on the identity of its parts: the probe session hands out the same tuples for
        the same stack ids, so most events are one lookup (on_bpf does that lookup inline).
        An event under an autograd node (`bwd_node`) gets the node's head (daemon/backward.py)
        in place of its Python frames."""
        py, nat, ops = ev.py_stack, ev.native_stack, ev.op_path
        node = getattr(ev, "bwd_node", 0)
        if node:
            h = self.backward.head(ev.tid, node)
            if h is not None:
                return self._backward_entry(ev, *h)
        key = (id(py), id(nat), id(ops))
        m = self._splice_memo.get(key)
        if m is not None and m[0] is py and m[1] is nat and m[2] is ops:
            return m
        return self._new_base_entry(ev, key)

    def _backward_entry(self, ev: Any, head: tuple[Frame, ...], linked: bool) -> list:
        """The memo entry of a backward event: head (forward context → backward:NODE) + the
        node's own operators and native frames below the engine's evaluate_function. An
        unlinked node's head follows the thread's own Python frames (where backward() ran)."""
        py, nat, ops = ev.py_stack, ev.native_stack, ev.op_path
        if linked:
            py = ()
        key = (id(head), id(py), id(nat), id(ops))
        m = self._backward_memo.get(key)
        if m is not None and m[0] is head and m[1] is nat and m[2] is ops and m[5] is py:
            return m
        native = tuple(nat)
        below = next((i for i in range(len(native) - 1, -1, -1) if "evaluate_function" in native[i].name), -1)
        own = splice(tuple(py), tuple(getattr(ev, "py_entries", ()) or ()), (), ()) if py else ()
        path = own + head + splice((), (), tuple(ops), native[below + 1:] if below >= 0 else native)
        if len(self._backward_memo) >= 65_536:
            self._backward_memo.clear()
        m = self._backward_memo[key] = [head, nat, ops, path, {}, py]
        return m

    def _new_base_entry(self, ev: Any, key: tuple[int, int, int]) -> list:
        """A memo miss: splice the event's stacks and remember them under `key` (their ids)."""
        py, nat, ops = ev.py_stack, ev.native_stack, ev.op_path
        path = splice(tuple(py), tuple(getattr(ev, "py_entries", ()) or ()), tuple(ops), tuple(nat))
        if len(self._splice_memo) >= 65_536:
            self._splice_memo.clear()
        m = self._splice_memo[key] = [py, nat, ops, path, {}]  # keeps the parts alive: ids stay unique
        return m

    # ---- agent side -----------------------------------------------------------------------
    def on_agent(self, rec: Any) -> None:
        self.stats.agent_records += 1
        kind = type(rec).__name__
        if kind == "KernelRecord" and self.order is not None:
            self.order.on_kernel(rec, int(self._clock() * 1e9))
            return
        if kind == "MemcpyRecord":
            self._on_copy_record(rec)
            return
        if kind == "PySample":
            frames = tuple(Frame.python(f, fn, ln) for (f, fn, ln) in rec.frames)
            if frames:
                self.tree.add_many(frames, {"py_samples": 1})
        elif kind == "ApiRecord":
            if "Launch" in rec.name:
                self._claim(rec)
            elif is_copy_api(rec.name):
                self._claim_copy(rec)
        elif kind == "KernelRecord":
            path = self._by_correlation.get(rec.correlation_id)
            if path is None:
                waiting = self._kernels_waiting.setdefault(rec.correlation_id, [])
                waiting.append(rec)
                if len(self._kernels_waiting) > PENDING_MAX_PER_THREAD:
                    self._kernels_waiting.pop(next(iter(self._kernels_waiting)))
                    self.stats.kernels_unmatched += 1
                return
            self._charge(path, rec)
        elif kind == "AgentStats":
            self.gpu_collector_active = bool(rec.gpu.get("active")) or self.gpu_collector_active
            ex = self.stats.extra           # the agent's own view, latest report (stats, /metrics)
            ex["agent_samples"] = _agent_gauge(rec.samples)
            ex["agent_sample_hz"] = _agent_gauge(rec.sample_hz)
            ex["agent_sample_cost_us"] = _agent_gauge(rec.sample_cost_us)
            for k in AGENT_DROP_KINDS:        # known names only: the keys come from the target
                v = rec.dropped.get(k)
                if isinstance(v, int) and not isinstance(v, bool):
                    ex[f"agent_dropped_{k}"] = _agent_gauge(v)
            if self.order is not None and rec.gpu.get("enabled_at_ns"):
                self.order.enabled_at_ns = max(self.order.enabled_at_ns, int(rec.gpu["enabled_at_ns"]))
                self.copy_order.enabled_at_ns = self.order.enabled_at_ns
        elif kind in ("HloMapRecord", "CompileRecord"):
            from stacklens.daemon.jaxjoin import on_agent_record
            on_agent_record(self, rec)
        elif kind == "Note":
            notes = self.meta.setdefault("notes", [])
            if len(notes) < 32:
                notes.append(f"agent {rec.level}: {rec.message}"[:300])

    def _claim(self, api: Any) -> None:
        """A CUPTI launch API record claims the BPF launch of the same thread inside its interval.

        Per thread, launches and their API records come in the same order: the record claims the
        last pending launch that entered before it ended; launches before that one were never
        reported by CUPTI (before activation, or dropped) and are counted, not charged.
        A runtime launch (cudaLaunchKernel) wraps a driver launch: the driver record (which exits
        first) claims the BPF event; the enclosing runtime record then maps its correlation id to
        the same path, so kernels correlated with either land on it.
        """
        claim = _claim_from(self._pending.get(api.tid), self._last_claim, api, self._launch_dropped)
        if claim is None:
            return
        self._by_correlation[api.correlation_id] = claim.path
        if len(self._by_correlation) > PENDING_MAX_PER_THREAD:
            self._by_correlation.popitem(last=False)
        for krec in self._kernels_waiting.pop(api.correlation_id, ()):
            self._charge(claim.path, krec)
        if self._copies_waiting:                # copy/memset nodes of a graph launch
            for crec in self._copies_waiting.pop(api.correlation_id, (0, ()))[1]:
                self._charge_copy(claim.path, crec)

    def _charge_memoized(self, path: tuple[Frame, ...] | None, krec: Any) -> bool:
        """`_charge`'s common case: the launching path (kept alive by the memo, so its id is its
        own) and the record's name were seen before; stages the kernel on the memoized charged
        path, learning the handle's name as `_charge` does. False (nothing done) on a miss.
        Only without JAX (jaxjoin splits kernels by operator)."""
        e = self._charge_memo.get(id(path))
        if e is None:
            return False
        hit = e[1].get(krec.name)
        if hit is None:
            return False
        if hit[1] is not None and len(self._handle_names) < HANDLE_NAMES_MAX and not getattr(krec, "graph_id", 0):
            self._handle_names[hit[1]] = hit[2]
        d = krec.end_ns - krec.start_ns
        self.tree.stage_pair(hit[0], self._i_gpu, d if d > 0 else 0, self._i_kernels, 1)
        self.stats.kernels_joined += 1
        return True

    def _charge(self, path: tuple[Frame, ...], krec: Any) -> None:
        self.gpu_collector_active = True
        if self.jax is None and self._charge_memoized(path, krec):
            return
        kname = demangle(krec.name)
        charged, handle = path, None
        if path[-1].kind != "kernel":
            charged = path + (Frame.kernel(kname),)
        elif path[-1].name != kname and path[-1].name.startswith("unresolved:"):
            # the handle's name, learnt from CUPTI: later launches of it land on the named node
            handle = path[-1].name
            if len(self._handle_names) < HANDLE_NAMES_MAX and not getattr(krec, "graph_id", 0):
                self._handle_names[handle] = kname
            charged = path[:-1] + (Frame.kernel(kname),)
        split = self.jax.split(charged, krec) if self.jax is not None else None
        if split is not None:  # a JAX kernel: one path per original operator (jaxjoin's rule)
            for p, m in split:
                self.tree.add_many(p, m)
            self.stats.kernels_joined += 1
            self.meta["jax"] = self.jax.meta()
            return
        if self.jax is None:
            memo = self._charge_memo
            e = memo.get(id(path))
            if e is None:
                if len(memo) >= 65_536:
                    memo.clear()
                e = memo[id(path)] = (path, {})
            if len(e[1]) < 1024:
                e[1][krec.name] = (charged, handle, kname)
        d = krec.end_ns - krec.start_ns
        self.tree.stage_pair(charged, self._i_gpu, d if d > 0 else 0, self._i_kernels, 1)
        self.stats.kernels_joined += 1

    def _charge_ordered(self, path: tuple[Frame, ...] | None, krec: Any) -> None:
        if type(krec) is MemcpyRecord:          # a copy/memset node of a graph, grouped with its kernels
            self._charge_copy(path, krec)
            return
        self.gpu_collector_active = True
        if self.jax is None and self._charge_memoized(path, krec):  # never for None: not memoized
            return
        if path is None:
            self.stats.kernels_unmatched += 1
            self.stats.kernels_joined -= 1     # _charge counts it; it was charged, not joined
            path = _UNSEEN
        self._charge(path, krec)

    # ---- copies and memsets (CUPTI MEMCPY / MEMSET activity) ---------------------------------
    # A copy or memset call seen by BPF (`kind = "memcpy"` probes; memsets have direction
    # "memset") adds its CPU time at once under `… → api:NAME`. With an agent the call then waits
    # for its CUPTI record, which charges GPU time, bytes and a count to `… → api:NAME →
    # memcpy:DtoH (Device -> Pinned)` / `memset:Device`; the bytes the call asked for are added
    # under `api:NAME` only if no record claims it, so bytes are never counted twice. Claims: by
    # order (`copy_order`, the default without API records: records in correlation-id order claim
    # calls whose (memcpy|memset, bytes) match) or exactly (API records of copy calls claim the
    # thread's call inside their interval, as launches). A copy node of a CUDA graph joins with
    # the graph's kernels. A record no call claims lands under `[copy call not seen]`: its GPU
    # time stays in the totals, counted in `copies_unjoined`.

    def _memset_unit(self, api: str) -> int:
        """Bytes per element of a memset call (cuMemsetD32Async: 4); 1 for byte counts."""
        u = self._memset_units.get(api)
        if u is None:
            m = _MEMSET_UNIT.search(api)
            u = int(m.group(1)) // 8 if m else 1
            if len(self._memset_units) < 4096:
                self._memset_units[api] = u
        return u

    def _on_copy_call(self, ev: Any, path: tuple[Frame, ...]) -> None:
        memset = getattr(ev, "direction", "") == "memset"
        nbytes = ev.bytes * self._memset_unit(ev.api) if memset else ev.bytes
        metric = "memset_bytes" if memset else "copy_bytes"
        if not self.agent:
            self.tree.add_many(path, {metric: nbytes, "api_cpu_ns": getattr(ev, "duration_ns", 0)})
            return
        self.tree.add_many(path, {"api_cpu_ns": getattr(ev, "duration_ns", 0)})
        call = _CopyCall(ev.ktime_ns, path, nbytes, metric)
        if self.copy_order is not None:
            self.copy_order.on_launch(ev.ktime_ns, call, ("memset" if memset else "memcpy", nbytes))
            return
        q = self._pending_copies[ev.tid]
        if q and ev.ktime_ns < q[-1].ktime_ns:
            q.insert(sorted_pos_from_end(q, ev.ktime_ns, _ktime_of), call)
        else:
            q.append(call)
        if len(q) > PENDING_MAX_PER_THREAD:
            self._copy_dropped(q.popleft())

    def _copy_dropped(self, call: _CopyCall) -> None:
        """A call no record claimed (before the collector was on, a lost record, too old): the
        bytes it asked for are all that is known of it."""
        self.tree.add_many(call.path, {call.metric: call.nbytes})
        ex = self.stats.extra
        ex["copy_calls_unmatched"] = ex.get("copy_calls_unmatched", 0) + 1

    def _on_copy_record(self, rec: MemcpyRecord) -> None:
        self.gpu_collector_active = True
        if self.copy_order is not None:
            now = int(self._clock() * 1e9)
            (self.order if rec.graph_id else self.copy_order).on_kernel(rec, now)
            return
        corr = rec.correlation_id
        target = self._copy_by_corr.get(corr) or self._by_correlation.get(corr)  # a call, or a graph launch
        if target is not None:
            self._charge_copy(target, rec)
            return
        w = self._copies_waiting.get(corr)
        if w is None:
            w = self._copies_waiting[corr] = [int(self._clock() * 1e9), []]
            if len(self._copies_waiting) > PENDING_MAX_PER_THREAD:
                for old in self._copies_waiting.pop(next(iter(self._copies_waiting)))[1]:
                    self._charge_copy(None, old)
        w[1].append(rec)

    def _launch_dropped(self, _pending: Any) -> None:
        self.stats.launches_unmatched += 1

    def _claim_copy(self, api: Any) -> None:
        """A CUPTI API record of a copy/memset call claims the thread's pending call inside its
        interval (`_claim`'s rule); calls before it were never reported and keep their own bytes."""
        claim = _claim_from(self._pending_copies.get(api.tid), self._last_copy_claim, api, self._copy_dropped)
        if claim is None:
            return
        self._copy_by_corr[api.correlation_id] = claim
        if len(self._copy_by_corr) > PENDING_MAX_PER_THREAD:
            self._copy_by_corr.popitem(last=False)
        for rec in self._copies_waiting.pop(api.correlation_id, (0, ()))[1]:
            self._charge_copy(claim, rec)

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

    def _charge_copy(self, target: Any, rec: MemcpyRecord) -> None:
        """GPU time, bytes and a count of one record under the call (a `_CopyCall`) or graph
        launch (a path) that issued it; None: `[copy call not seen]`."""
        self.gpu_collector_active = True
        ex = self.stats.extra
        if target is None:
            path = _COPY_UNSEEN
            ex["copies_unjoined"] = ex.get("copies_unjoined", 0) + 1
        else:
            path = target.path if type(target) is _CopyCall else target
            ex["copies_joined"] = ex.get("copies_joined", 0) + 1
        d = rec.end_ns - rec.start_ns
        if rec.kind == "memset":
            m = {"gpu_time_ns": d if d > 0 else 0, "memset_count": 1, "memset_bytes": rec.bytes}
        else:
            m = {"gpu_time_ns": d if d > 0 else 0, "memcpy_count": 1, "copy_bytes": rec.bytes}
        self.tree.add_many(path + (self._copy_frame(rec),), m)

    def _expire_copies(self, now_ns: int, force: bool = False) -> None:
        """Calls and records that waited too long (all of them at detach): calls keep their own
        bytes, records land under `[copy call not seen]`."""
        ex = self.stats.extra
        if self.copy_order is not None:
            if force:
                self.copy_order.drain(0, self._charge_copy, force=True)
                self.copy_order.discard()
            else:
                self.copy_order.drain(int(self._clock() * 1e9), self._charge_copy)
            for k, v in self.copy_order.stats.items():
                ex["copy_" + k] = v
            return
        for q in self._pending_copies.values():
            while q and (force or now_ns - q[0].ktime_ns > PENDING_MAX_AGE_NS):
                self._copy_dropped(q.popleft())
        if self._copies_waiting:
            now = int(self._clock() * 1e9)
            for corr in [c for c, w in self._copies_waiting.items() if force or now - w[0] > COPY_WAIT_MAX_NS]:
                for rec in self._copies_waiting.pop(corr)[1]:
                    self._charge_copy(None, rec)

    def flush(self) -> None:
        """End of a batch: apply the staged launch/kernel counts to the tree (see the module
        docstring). Snapshots, `expire()` and `finish()` flush by themselves."""
        self.tree.flush()

    def finish(self) -> None:
        """At detach: join what is still waiting (the order join's unsettled kernel groups, the
        copies and memsets)."""
        if self.order is not None:
            self.order.drain(0, self._charge_ordered, force=True)
            self.stats.extra.update(self.order.stats)
        self._expire_copies(0, force=True)
        self.tree.flush()

    def expire(self, now_ns: int) -> None:
        if self.order is not None:
            self.order.drain(int(self._clock() * 1e9), self._charge_ordered)
            self.stats.extra.update(self.order.stats)
        if self.backward.stats:
            self.stats.extra.update(self.backward.stats)
            self.stats.extra.update(self.backward.sizes())
        for q in self._pending.values():
            while q and now_ns - q[0].ktime_ns > PENDING_MAX_AGE_NS:
                q.popleft()
                self.stats.launches_unmatched += 1
        self._expire_copies(now_ns)
        self.tree.flush()

    # ---- reading --------------------------------------------------------------------------
    def unavailable(self) -> set[str]:
        out = set()
        if not self.agent:
            out.add("py_samples")
        if not (self.agent and self.gpu_collector_active):
            out.update(GPU_MEASURED)  # no agent, or an agent without a GPU collector (CPU job)
        if self.jax is None or not self.jax.stats["compile_events"]:
            out.add("compile_time_ns")  # measured only for JAX targets (jax.monitoring)
        return out

    def snapshot(self, window_s: float | None = None) -> Snapshot:
        meta = dict(self.meta)
        if self.backward.stats:   # how much backward work found its forward context
            meta["backward_link"] = dict(self.backward.stats)
        return self.tree.snapshot(window_s=window_s, meta=meta, unavailable=self.unavailable())
