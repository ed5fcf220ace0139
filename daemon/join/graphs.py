"""CUDA-graph replays split per kernel onto the code that captured them.

A graph launch (``cuGraphLaunch``) runs every kernel of the graph under one correlation id, so the
launch's path alone puts all of their GPU time on the line that replays the graph. CUPTI gives each
replayed kernel its graph (``graph_id``) and node (``graph_node_id``: the same on every replay,
measured on the H200, docs/benchmarks/gpu-run33-graphs). Here each node gets the context that made
it, and a replayed kernel is charged to

    replay path (… → api:cuGraphLaunch) → [graph] → the capture-time launch path (py → op → … → api) → kernel:NAME

Rules (also in the snapshot's ``meta["notes"]``; counts in ``meta["graphs"]``):
- **captured while attached**: the probes see the capture (``cuStreamBeginCapture`` …
  ``cuStreamEndCapture`` on a thread: kind "capture") and every launch of that thread in between,
  with its path. The first replay of a graph (its kernels in start order) is matched to the capture
  whose kernel names it follows best, in order (at least half of the replay's kernels matched); each
  node then keeps the path of the captured launch it was matched to. Names compare after CUPTI named
  the launch's handle; a launch whose handle was never named matches any kernel at its place.
- **captured before attach, torch.compile**: Inductor's wrapper modules (daemon/join/compiled.py)
  list the kernels each module calls, in order. The replay is matched to the module with most of
  its Triton kernels (those keep Inductor's names in CUPTI); a Triton kernel takes the line of its
  call, a library kernel (GEMMs, attention) the extern call between its Triton neighbours that its
  name's family fits (a GEMM never on an attention call; split-K reductions stay on their GEMM); the path
  is ``… → [graph: captured before attach; Inductor map] → model stack trace → op:[compiled] … → kernel``.
- **captured before attach, anything else**: ``… → [graph: captured before attach] → kernel:NAME`` —
  named, never put on an invented line.
- A node's context is decided once per (graph, node) and reused; a graph whose first replay is not
  complete yet waits (its kernels are held, at most MAX_HELD, until a kernel of its next replay or
  the next `flush`). Bounded: MAX_CAPTURES captures of at most MAX_CAPTURE_LAUNCHES launches,
  MAX_NODES node contexts; what is refused is counted.
"""

from __future__ import annotations

import bisect
import collections
from typing import Callable

from stacklens.cct import Frame
from stacklens.records.agent import KernelRecord

Path = tuple[Frame, ...]

GRAPH = Frame.other("[graph]")
BEFORE_ATTACH = Frame.other("[graph: captured before attach]")
BY_INDUCTOR = Frame.other("[graph: captured before attach; Inductor map]")
GRAPH_NOTE = ("graphs: a CUDA-graph replay's kernels are charged per node under the replay's path: → [graph] → "
              "the captured launch's path when the capture was seen; → [graph: captured before attach; "
              "Inductor map] → the model line of the Inductor call it matches; else → [graph: captured before "
              "attach] → the kernel (meta graphs); replayed kernels' records come a full CUPTI buffer at a time "
              "(or at detach), so a slow replay loop's GPU time shows late")
MAX_CAPTURES = 256
MAX_CAPTURE_LAUNCHES = 1 << 16
MAX_CAPTURED = 1 << 20           # launches kept over all captures
MAX_NODES = 1 << 20
MAX_HELD = 1 << 16
MAX_GRAPHS = 1 << 16
MIN_MATCH = 0.5                  # share of a replay's kernels a capture or module must match


class Capture:
    """One stream capture seen by the probes: its launches' paths and kernel names, in order."""
    __slots__ = ("tid", "paths", "names", "graphs", "truncated")

    def __init__(self, tid: int) -> None:
        self.tid = tid
        self.paths: list[Path] = []
        self.names: list[str] = []
        self.graphs = 0              # graphs bound to it
        self.truncated = False


def align(replay: list[str], known: list[str], wildcard: Callable[[str], bool] = lambda n: False) -> list[int | None]:
    """Each replayed kernel's position in `known` (a capture's names in launch order), matched in
    order: the next position if its name is the same (or a wildcard), else the next position
    further on with the same name; None where none is."""
    at: dict[str, list[int]] = collections.defaultdict(list)
    for i, n in enumerate(known):
        at[n].append(i)
    out: list[int | None] = []
    i = 0
    for n in replay:
        if i < len(known) and (known[i] == n or wildcard(known[i])):
            out.append(i)
            i += 1
            continue
        ps = at.get(n)
        j = bisect.bisect_left(ps, i) if ps else 0
        if ps and j < len(ps):
            out.append(ps[j])
            i = ps[j] + 1
        else:
            out.append(None)
    return out


_ATTN_KERNEL = ("fmha", "flash", "attention", "attn")
_GEMM_KERNEL = ("gemm", "xmma", "cutlass", "splitk", "nvjet", "cublas", "gemv", "conv", "cudnn", "winograd")
_AFTER_KERNEL = ("splitkreduce", "epilogue")      # a library call's trailing kernels
_GEMM_CALLS = ("mm", "addmm", "bmm", "baddbmm", "_int_mm", "convolution", "_scaled_mm")


def kernel_family(name: str) -> str | None:
    """What a library kernel's name says it does: "attn", "gemm", or None (can't tell)."""
    s = name.lower()
    if any(k in s for k in _ATTN_KERNEL):
        return "attn"
    if any(k in s for k in _GEMM_KERNEL):
        return "gemm"
    return None


def call_family(call: str) -> str | None:
    """The same for a wrapper's library call (``extern_kernels.addmm``, ``aten._scaled_dot_…``)."""
    op = call.rpartition(".")[2]
    if "attention" in op:
        return "attn"
    return "gemm" if op in _GEMM_CALLS else None


def _fits(kernel: str | None, call: str | None) -> bool:
    return kernel is None or call is None or kernel == call


def align_calls(replay: list[str], calls: list[tuple[str, bool]]) -> list[int | None]:
    """Replayed kernels -> positions among a wrapper's calls [(kernel, is Triton)], in order: a
    Triton kernel takes the next call of its name; a library kernel the next extern call before
    the next Triton call, or (a call that launched several) the extern call it follows. A GEMM
    kernel never goes to an attention call nor the reverse where the names say so
    (`kernel_family`), and a GEMM's trailing kernels (split-K reduction, epilogue) stay on it."""
    at: dict[str, list[int]] = collections.defaultdict(list)
    fam = [None if triton else call_family(n) for n, triton in calls]
    for i, (n, triton) in enumerate(calls):
        if triton:
            at[n].append(i)
    out: list[int | None] = []
    i = 0
    last_extern: int | None = None
    for n in replay:
        ps = at.get(n)
        if ps is not None:
            j = bisect.bisect_left(ps, i)
            if j < len(ps):
                out.append(ps[j])
                i = ps[j] + 1
            else:
                out.append(None)
            last_extern = None
            continue
        kf = kernel_family(n)
        trailing = last_extern is not None and any(k in n.lower() for k in _AFTER_KERNEL)
        stay = trailing or (last_extern is not None and _fits(kf, fam[last_extern]) and not (
            i < len(calls) and not calls[i][1] and _fits(kf, fam[i])))
        if not stay:
            # the next extern call this kernel fits, before the next Triton call (else the next one)
            run = range(i, next((k for k in range(i, len(calls)) if calls[k][1]), len(calls)))
            nxt = next((k for k in run if _fits(kf, fam[k])), run[0] if run else None)
            if nxt is None and last_extern is None:
                nxt = next((k for k in range(i, len(calls)) if not calls[k][1] and _fits(kf, fam[k])), None)
            if nxt is not None:
                last_extern, i = nxt, nxt + 1
        out.append(last_extern)
    return out


class _Replay:
    """The held kernels of a graph's first replay (no node contexts decided yet)."""
    __slots__ = ("corr", "launch", "recs")

    def __init__(self, corr: int, launch: Path) -> None:
        self.corr, self.launch, self.recs = corr, launch, []


class GraphSplit:
    """Owned by the join (aggregation thread). `kernel` and `flush` return the (path, record)
    pairs to charge; `demangle` names a record, `inductor()` is the process's InductorIndex or None."""

    def __init__(self, demangle: Callable[[str], str], inductor: Callable[[], object]) -> None:
        self._demangle = demangle
        self._inductor = inductor
        self.open: dict[int, Capture] = {}              # tid -> capture in progress
        self.captures: collections.deque[Capture] = collections.deque()
        self._captured = 0
        self._nodes: dict[tuple[int, int], tuple[Path, Path, Path]] = {}   # (graph, node) -> (suffix, launch, path)
        self._bound: dict[int, object] = {}             # graph -> Capture | (module, calls) | None
        self._held: dict[int, _Replay] = {}
        self._n_held = 0
        self.stats = collections.Counter()

    # ---- capture (BPF) ---------------------------------------------------------------------
    def on_capture(self, tid: int, begin: bool) -> None:
        if begin:
            self.open[tid] = Capture(tid)
            self.stats["captures_seen"] += 1
            return
        c = self.open.pop(tid, None)
        if c is None or not c.paths:
            return
        while self.captures and (len(self.captures) >= MAX_CAPTURES or self._captured + len(c.paths) > MAX_CAPTURED):
            old = self.captures.popleft()
            self._captured -= len(old.paths)
            self.stats["captures_dropped"] += 1
        self.captures.append(c)
        self._captured += len(c.paths)

    def on_launch(self, tid: int, path: Path) -> bool:
        """A launch: True if its thread is capturing (a node of the graph being built, kept)."""
        c = self.open.get(tid)
        if c is None:
            return False
        if len(c.paths) >= MAX_CAPTURE_LAUNCHES:
            c.truncated = True
            self.stats["capture_launches_dropped"] += 1
            return True
        c.paths.append(path)
        c.names.append(path[-1].name if path and path[-1].kind == "kernel" else "")
        return True

    # ---- replays (CUPTI) -------------------------------------------------------------------
    def known(self, launch: Path, rec: KernelRecord) -> Path | None:
        """The hot path: the charged path of a node decided before, while no replay of its graph
        is held; None otherwise (then `kernel`)."""
        key = (rec.graph_id, rec.graph_node_id)
        hit = self._nodes.get(key)
        if hit is None or rec.graph_id in self._held:
            return None
        if hit[1] is not launch:
            hit = self._nodes[key] = (hit[0], launch, launch + hit[0])
        return hit[2]

    def kernel(self, launch: Path, rec: KernelRecord) -> list[tuple[Path, KernelRecord]]:
        """Where a replayed kernel is charged: at once when its node's context is known, else
        held with its replay (returned later by this call or `flush`)."""
        out: list[tuple[Path, KernelRecord]] = []
        h = self._held.get(rec.graph_id)
        if h is not None and h.corr != rec.correlation_id:     # the held replay is complete
            out = self._settle(rec.graph_id)
            h = None
        if h is None and rec.graph_node_id:
            key = (rec.graph_id, rec.graph_node_id)
            hit = self._nodes.get(key)
            if hit is not None:
                suffix, at, path = hit
                if at is not launch:
                    path = launch + suffix
                    self._nodes[key] = (suffix, launch, path)
                out.append((path, rec))
                return out
        if h is None:
            if len(self._held) >= MAX_GRAPHS:
                out.extend(self._settle(next(iter(self._held))))
            h = self._held[rec.graph_id] = _Replay(rec.correlation_id, launch)
        h.recs.append(rec)
        self._n_held += 1
        if self._n_held > MAX_HELD:
            out.extend(self.flush())
        return out

    def flush(self) -> list[tuple[Path, KernelRecord]]:
        """Every held replay decided and returned (the join calls this on its clock tick)."""
        out: list[tuple[Path, KernelRecord]] = []
        for g in list(self._held):
            out.extend(self._settle(g))
        return out

    def waiting(self) -> int:
        return self._n_held

    def _settle(self, graph: int) -> list[tuple[Path, KernelRecord]]:
        h = self._held.pop(graph)
        self._n_held -= len(h.recs)
        recs = sorted(h.recs, key=lambda r: r.start_ns)
        names = [self._demangle(r.name) for r in recs]
        if graph not in self._bound:    # bound once; an unknown graph again after forget_unknown
            if len(self._bound) < MAX_GRAPHS:
                self._bound[graph] = self._bind(names)
            self.stats["graphs"] = len(self._bound)
        bound = self._bound.get(graph)
        out = []
        if isinstance(bound, Capture):
            pos = align(names, bound.names, lambda n: n.startswith("unresolved:"))
            suffixes = [None if p is None else (GRAPH,) + bound.paths[p][:-1] for p in pos]
            how = "capture"
        elif bound is not None:
            _m, calls, tails = bound
            pos = align_calls(names, calls)
            suffixes = [None if p is None or tails[p] is None else (BY_INDUCTOR,) + tails[p] for p in pos]
            how = "inductor"
        else:
            suffixes = [None] * len(recs)
            how = "unknown"
        for rec, name, suffix in zip(recs, names, suffixes):
            if suffix is None:
                suffix = (BEFORE_ATTACH,)
                self.stats["nodes_named_only"] += 1
            else:
                self.stats[f"nodes_by_{how}"] += 1
            suffix = suffix + (Frame.kernel(name),)
            path = h.launch + suffix
            if rec.graph_node_id and len(self._nodes) < MAX_NODES:
                self._nodes[(graph, rec.graph_node_id)] = (suffix, h.launch, path)
            out.append((path, rec))
        return out

    def _bind(self, names: list[str]) -> object:
        """The capture (newest first) or Inductor module a first replay matches best, or None."""
        need = max(1, int(len(names) * MIN_MATCH + 0.999))
        best, score = None, 0
        for c in reversed(self.captures):
            s = sum(p is not None for p in align(names, c.names, lambda n: n.startswith("unresolved:")))
            if s > score or (s == score and best is not None and best.graphs > c.graphs):
                best, score = c, s
        if best is not None and score >= need:
            best.graphs += 1
            self.stats["graphs_by_capture"] += 1
            return best
        index = self._inductor()
        if index is not None:
            mod = index.best_module(names)
            if mod is not None:
                calls, tails = index.calls(mod)
                s = sum(p is not None for p in align_calls(names, calls))
                if s >= need:
                    self.stats["graphs_by_inductor"] += 1
                    return (mod, calls, tails)
        self.stats["graphs_unknown"] += 1
        return None

    def forget_unknown(self) -> None:
        """Graphs matched to nothing are matched again at their next replay (an Inductor module
        arrived: the agent sends them after it attached, while replays already run)."""
        gone = {g for g, b in self._bound.items() if b is None}
        if not gone:
            return
        for g in gone:
            del self._bound[g]
        for key in [k for k in self._nodes if k[0] in gone]:
            del self._nodes[key]

    def meta(self) -> dict[str, int]:
        d = dict(self.stats)
        d["captures_kept"] = len(self.captures)
        d["nodes_known"] = len(self._nodes)
        return d

