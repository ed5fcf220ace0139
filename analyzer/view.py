"""One pass over a snapshot that every rule shares: per-node Python line, measured columns, and
the process's time base.

Pure, no privilege, no I/O. Building a `View` is O(nodes x metrics); rules then work on plain
lists. `view_of(snapshot)` keeps the last few views so that `analyze()` builds one per snapshot,
not one per rule; a cached entry holds its snapshot, so a recycled `id()` can never hit it.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable, Iterable, Sequence
from itertools import repeat

from stacklens.cct import Frame, Snapshot

CPU_METRICS = ("cpu_samples", "py_samples")
_WALL_META = (("duration_ns", 1.0), ("wall_ns", 1.0), ("duration_s", 1e9), ("window_s", 1e9))
_HZ_META = ("cpu_hz", "sample_hz")


def op_base(name: str) -> str:
    """`aten::add_Tensor` -> `add_Tensor`; op names keep their overload suffix (at::_ops naming)."""
    return name.rpartition("::")[2]


_OPS_NS = "at::_ops::"


def op_of_native(name: str) -> str | None:
    """The op of a demangled native frame inside an operator's dispatcher entry, named as op
    frames are: `at::_ops::select_int::call(at::Tensor const&, …)` -> `aten::select_int`;
    None for any other native frame."""
    if not name.startswith(_OPS_NS):
        return None
    return "aten::" + name[len(_OPS_NS):].split("::", 1)[0]


class View:
    """Read-only index over one snapshot.

    line[n]     the nearest Python frame at or above n (0 when none): the line a cost belongs to
    excl[m]     exclusive values of each *measured* metric (metrics in `unavailable` are absent)
    cpu_metric  which sample metric stands for CPU time: cpu_samples (BPF), else py_samples
    wall_ns     the process's time base for ns metrics, and where it came from (`wall_source`)
    """

    def __init__(self, snap: Snapshot) -> None:
        self.snap = snap
        n = snap.node_count
        self.n = n
        self.unavailable = frozenset(snap.unavailable)
        self.measured = tuple(m for m in snap.metrics if m not in self.unavailable)
        self.excl: dict[str, list[int] | tuple[int, ...]] = {}
        # Snapshot's own tuples when present (as cct.tree.CCT.absorb_snapshot does): a method
        # call per node and metric would be most of the analysis time on a 100k-node tree.
        cols = getattr(snap, "_excl", None)
        frames = getattr(snap, "_frames", None)
        parents = getattr(snap, "_parents", None)
        if frames is None or parents is None or cols is None:
            frames = [snap.frame_of(i) for i in range(n)]
            parents = [snap.parent(i) for i in range(n)]
            cols = {m: list(map(snap.exclusive, range(n), repeat(m))) for m in self.measured}
        self.frames: Sequence[Frame] = frames
        self.parents: Sequence[int] = parents
        for m in self.measured:
            col = cols[m]
            if any(col):
                self.excl[m] = col
        self.totals = {m: snap.total(m) for m in self.measured}

        # Frames interned to ints: predicates run once per distinct frame, then by list index.
        ids: dict[Frame, int] = {}
        self.frame_id = [ids.setdefault(f, len(ids)) for f in self.frames]
        self.distinct: list[Frame] = list(ids)
        is_py = [f.kind == "python" for f in self.distinct]
        self.is_python = [is_py[k] for k in self.frame_id]

        line = [0] * n
        parents, py = self.parents, self.is_python
        for i in range(1, n):
            line[i] = i if py[i] else line[parents[i]]
        self.line = line
        self._memo: dict[str, object] = {}

        self.cpu_metric = next((m for m in CPU_METRICS if self.totals.get(m)), None)
        self.wall_ns, self.wall_source = self._wall()
        self._labels: dict[int, tuple[str, ...]] = {}

    def _wall(self) -> tuple[float | None, str]:
        """The window's length: what meta says (top-level keys, then `window.seconds`), unless
        the tree itself proves the window longer: no thread can be on CPU longer than the window,
        so its CPU samples / cpu_hz are a lower bound. (A window drained past its end held more
        than meta.window said: the H200 run 31 profiles say 5 s and hold ~35 s of one thread's
        samples.) Without meta: that bound, else the GPU and API time."""
        meta = self.snap.meta
        stated = next(((float(meta[k]) * scale, f"meta.{k}") for k, scale in _WALL_META
                       if isinstance(meta.get(k), (int, float)) and meta[k] > 0), None)
        window = meta.get("window")
        if stated is None and isinstance(window, dict):
            sec = window.get("seconds")
            if isinstance(sec, (int, float)) and sec > 0:
                stated = (float(sec) * 1e9, "meta.window.seconds")
        bound = self._thread_bound()
        if stated is not None:
            if bound is not None and bound[0] > 1.05 * stated[0]:
                return bound[0], f"{bound[1]} (longer than {stated[1]})"
            return stated
        if bound is not None:
            return bound
        busy = max(
            self.totals.get("gpu_time_ns", 0),
            self.totals.get("api_cpu_ns", 0) + self.totals.get("sync_wait_ns", 0),
        )
        if busy:
            return float(busy), "max(gpu_time_ns, api_cpu_ns + sync_wait_ns)"
        return None, "none"

    def _thread_bound(self) -> tuple[float, str] | None:
        """(ns, source): the busiest thread's CPU samples / cpu_hz where samples are kept per
        thread, else all samples / hz (the older fallback)."""
        meta = self.snap.meta
        hz = next((meta[k] for k in _HZ_META if isinstance(meta.get(k), (int, float)) and meta[k] > 0), None)
        total = self.totals.get("cpu_samples")
        if not hz or not total:
            return None
        per = self.thread_cpu_samples()
        if per:
            return max(per.values()) / hz * 1e9, "busiest thread's cpu_samples/cpu_hz"
        return total / hz * 1e9, "cpu_samples/hz"

    def thread_cpu_samples(self) -> dict[int, int]:
        """CPU samples per thread id ({} where the snapshot does not keep them per thread)."""
        col = self.excl.get("cpu_samples")
        if col is None or "cpu_samples" not in self.snap.threaded:
            return {}

        def compute() -> dict[int, int]:
            out: dict[int, int] = {}
            threads = self.snap.threads
            for node, v in enumerate(col):
                if v:
                    for tid, c in threads(node, "cpu_samples"):
                        out[tid] = out.get(tid, 0) + c
            return out

        return self.memo("thread_cpu_samples", compute)  # type: ignore[return-value]

    @property
    def cpu_hz(self) -> float | None:
        meta = self.snap.meta
        return next((float(meta[k]) for k in _HZ_META if isinstance(meta.get(k), (int, float)) and meta[k] > 0), None)

    # -- values --------------------------------------------------------------------------

    def has(self, metric: str) -> bool:
        return metric in self.measured

    def col(self, metric: str) -> Sequence[int] | None:
        """Exclusive column of a measured metric with any non-zero value, else None."""
        return self.excl.get(metric)

    def cpu_share(self, samples: float) -> float:
        total = self.totals.get(self.cpu_metric, 0) if self.cpu_metric else 0
        return samples / total if total else 0.0

    def ns_share(self, ns: float) -> float:
        return min(1.0, ns / self.wall_ns) if self.wall_ns else 0.0

    def gpu_share(self, gpu_ns: float) -> float:
        """Share of the process's time; of all GPU time when there is no better time base."""
        if self.wall_ns:
            return min(1.0, gpu_ns / self.wall_ns)
        total = self.totals.get("gpu_time_ns", 0)
        return gpu_ns / total if total else 0.0

    def unavailable_evidence(self, *metrics: str) -> dict[str, float]:
        return {f"{m}_unavailable": 1.0 for m in metrics if m in self.snap.metrics and m in self.unavailable}

    # -- structure -----------------------------------------------------------------------

    def labels(self, node: int) -> tuple[str, ...]:
        cached = self._labels.get(node)
        if cached is None:
            cached = tuple(f.label() for f in self.snap.path(node))
            self._labels[node] = cached
        return cached

    def mark(
        self, predicate: Callable[[Frame], bool], *, kinds: Iterable[str] | None = None, reset_at_python: bool = True
    ) -> list[int]:
        """For every node, the outermost frame on its path (below its Python line) for which
        `predicate` holds, or 0. The predicate runs once per distinct frame, and only on frames
        of `kinds` when given."""
        if kinds is None:
            hits = [bool(predicate(f)) for f in self.distinct]
        else:
            ks = frozenset(kinds)
            hits = [f.kind in ks and bool(predicate(f)) for f in self.distinct]
        fid, parents, py = self.frame_id, self.parents, self.is_python
        out = [0] * self.n
        for i in range(1, self.n):
            if reset_at_python and py[i]:
                continue
            up = out[parents[i]]
            if up:
                out[i] = up
            elif hits[fid[i]]:
                out[i] = i
        return out

    def memo(self, key: str, compute: Callable[[], object]) -> object:
        """Per-view cache for intermediate results two rules share."""
        if key not in self._memo:
            self._memo[key] = compute()
        return self._memo[key]

    def sum_by_line(self, nodes: Iterable[int], metrics: Iterable[str]) -> dict[int, dict[str, int]]:
        """Exclusive values of `nodes`, summed per Python line."""
        cols = [(m, self.excl[m]) for m in metrics if m in self.excl]
        line = self.line
        out: dict[int, dict[str, int]] = {}
        for i in nodes:
            acc = out.get(line[i])
            if acc is None:
                acc = out[line[i]] = dict.fromkeys((m for m, _ in cols), 0)
            for m, col in cols:
                v = col[i]
                if v:
                    acc[m] += v
        return out

    def nodes_with_value(self, metrics: Iterable[str]) -> list[int]:
        cols = [self.excl[m] for m in metrics if m in self.excl]
        if not cols:
            return []
        return [i for i, vals in enumerate(zip(*cols)) if any(vals)]


def name_matcher(*patterns: str) -> Callable[[str], bool]:
    rx = re.compile("|".join(f"(?:{p})" for p in patterns), re.IGNORECASE)
    return lambda s: rx.search(s) is not None


_cache: list[tuple[Snapshot, View]] = []
_cache_lock = threading.Lock()
_CACHE_SIZE = 4


def view_of(snap: Snapshot) -> View:
    with _cache_lock:
        for s, v in _cache:
            if s is snap:
                return v
    v = View(snap)
    with _cache_lock:
        _cache.append((snap, v))
        del _cache[:-_CACHE_SIZE]
    return v
