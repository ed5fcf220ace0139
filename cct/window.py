"""Time windows over the CCT, and merge / diff of snapshots.

Pure data, no privilege, no I/O, not thread-safe (owned by the aggregation thread, like `CCT`).

`WindowedCCT` keeps one small tree per time bucket (`bucket_s`, on a monotonic clock). Events go
into the open bucket only, so the hot path costs one `CCT.add` plus a float compare. When time
moves past the open bucket, it is closed: added once into the cumulative tree and kept for
window views until it is older than `horizon_s`. Memory is therefore bounded by
`horizon_s / bucket_s` buckets of at most `max_nodes` nodes each, plus the cumulative tree,
and by bytes: `max_bytes` (DEFAULT_MAX_BYTES, 192 MiB) for all of them together, frame strings
included (CCT.estimated_bytes). A third of it is the cumulative tree's byte cap, a sixth the open
bucket's (both fold their coldest contexts into `[other]` past it, totals conserved), half is
for the closed buckets: past it the oldest are dropped before their horizon (window views then
reach back less far). What the budget cost is counted (`memory()`) and shown in the snapshot's
meta (`"memory"`) once anything was folded or dropped for it. A hostile target sending unique
8 KiB frame names held 5.4 GiB of a daemon in 74 s before (issue 17); now a session's tree stays
within 192 MiB and the agent channel's queue within 64 MiB (inject/channel/recordqueue.py).

Views are built when asked for:
- cumulative: a copy of the cumulative tree plus the open bucket;
- last `window_s` seconds: the newest ceil(window_s / bucket_s) buckets (the open one included)
  merged into a fresh tree, so the window is exact to a bucket; its meta says the seconds it
  covers (`window_s`: less than asked for a tree younger than the window). Cost grows with the number of
  nodes in those buckets, e.g. 120 one-second buckets of 3,000 contexts merge 360,000 nodes.
Time never goes backwards inside the tree: an event stamped before the open bucket (ring
buffers of different CPUs deliver slightly out of order) is counted in the open bucket.

Pre-aggregation (`stage` / `flush`): a hot caller that adds the same path object many times (the
daemon's join: one launch_count per launch, gpu_time_ns + kernel_count per kernel, ~25k each a
second on a busy GPU) stages its adds instead: a staged add is one clock read and one dict lookup
keyed by the path's identity (no hashing of a 40-frame tuple); `flush()` applies each distinct
path's sums to the open bucket with one path lookup. Staged values always land in the bucket
that was open when they were staged: moving to a new bucket flushes first, and so do
`snapshot()` (nothing staged is ever missing from a view) and a staging dict past STAGE_MAX paths.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from stacklens.cct.frames import Frame
from stacklens.cct.snapshot import Snapshot
from stacklens.cct.tree import CCT, METRICS

STAGE_MAX = 4096  # distinct staged paths before a flush (bounds what staging holds alive)
DEFAULT_MAX_BYTES = 192 << 20  # a session's trees together (see the module docstring)


class WindowedCCT:
    """A CCT with cumulative and sliding-window views; see the module docstring."""

    def __init__(
        self,
        metrics: Sequence[str] = METRICS,
        bucket_s: float = 1.0,
        horizon_s: float = 120.0,
        max_nodes: int | None = 100_000,
        clock: Callable[[], float] = time.monotonic,
        max_bytes: int | None = DEFAULT_MAX_BYTES,
    ) -> None:
        if not bucket_s > 0 or not horizon_s >= bucket_s:
            raise ValueError(f"need 0 < bucket_s <= horizon_s, got bucket_s={bucket_s}, horizon_s={horizon_s}")
        self.metrics = tuple(metrics)
        self.bucket_s = bucket_s
        self.horizon_s = horizon_s
        self.max_nodes = max_nodes
        self.max_bytes = max_bytes
        self._clock = clock
        self._n_buckets = math.ceil(horizon_s / bucket_s)
        self._cumulative_cap = None if max_bytes is None else max_bytes // 3
        self._open_cap = None if max_bytes is None else max_bytes // 6
        self._closed_cap = None if max_bytes is None else max_bytes - self._cumulative_cap - self._open_cap
        self._cumulative = CCT(self.metrics, max_nodes, self._cumulative_cap)
        self._closed: deque[tuple[int, CCT]] = deque()
        self._closed_bytes = 0
        self._evicted = 0          # closed buckets dropped before their horizon, for the budget
        self._closed_folded = 0    # budget_folded of the buckets closed so far
        self._open = CCT(self.metrics, max_nodes, self._open_cap)
        self._open_idx = -(2**62)
        self._open_end = -math.inf
        self._first_t: float | None = None   # the clock at the first event: a young tree's window starts there
        # id(path) -> [value of metric 0, value of metric 1, ..., path]; the entry keeps the
        # path alive, so an id is never reused while it is staged
        self._staged: dict[int, list] = {}
        self._zeros = [0] * len(self.metrics)

    def metric_index(self, metric: str) -> int:
        """The index `stage` takes for `metric` (KeyError if this tree does not record it)."""
        try:
            return self.metrics.index(metric)
        except ValueError:
            raise KeyError(f"unknown metric {metric!r}; this tree records {self.metrics}") from None

    def stage(self, path: tuple[Frame, ...], i: int, value: int) -> None:
        """Like `add(path, self.metrics[i], value)`, pre-aggregated by path identity until `flush()`
        (see the module docstring). Reuse the same tuple for the same path to profit."""
        t = self._clock()
        if t >= self._open_end:
            self._advance(t)
        s = self._staged.get(id(path))
        if s is None:
            if len(self._staged) >= STAGE_MAX:
                self.flush()
            s = self._staged[id(path)] = [*self._zeros, path]
        s[i] += value

    def stage_pair(self, path: tuple[Frame, ...], i: int, value: int, j: int, value_j: int) -> None:
        """Two `stage` calls for one path (metric i += value, metric j += value_j) for the price of one."""
        t = self._clock()
        if t >= self._open_end:
            self._advance(t)
        s = self._staged.get(id(path))
        if s is None:
            if len(self._staged) >= STAGE_MAX:
                self.flush()
            s = self._staged[id(path)] = [*self._zeros, path]
        s[i] += value
        s[j] += value_j

    def flush(self) -> None:
        """Apply the staged sums to the open bucket (one path lookup per distinct staged path)."""
        staged = self._staged
        if not staged:
            return
        self._staged = {}
        add_row = self._open.add_row
        error = None
        for s in staged.values():  # [value of metric 0, ..., path]: add_row stops at the metrics
            try:
                add_row(s[-1], s)
            except (TypeError, KeyError) as exc:  # not a path of Frames: the others still count
                error = error or exc
        if error is not None:
            raise error

    def add(self, path: tuple[Frame, ...], metric: str, value: int, now: float | None = None) -> None:
        t = self._clock() if now is None else now
        if t >= self._open_end:
            self._advance(t)
        self._open.add(path, metric, value)

    def add_sample(self, path: tuple[Frame, ...], metric: str, tid: int, value: int = 1,
                   now: float | None = None) -> None:
        """`add`, also counted by thread (`CCT.add_sample`)."""
        t = self._clock() if now is None else now
        if t >= self._open_end:
            self._advance(t)
        self._open.add_sample(path, metric, tid, value)

    def add_many(self, path: tuple[Frame, ...], deltas: Mapping[str, int], now: float | None = None) -> None:
        t = self._clock() if now is None else now
        if t >= self._open_end:
            self._advance(t)
        self._open.add_many(path, deltas)

    def _advance(self, t: float, event: bool = True) -> None:
        """Close the open bucket if `t` lies past it, and expire buckets beyond the horizon."""
        if event and self._first_t is None:
            self._first_t = t
        if t < self._open_end:
            return
        if self._staged:
            self.flush()  # staged while this bucket was open: it is theirs
        idx = max(math.floor(t / self.bucket_s), self._open_idx + 1)
        if not _empty(self._open):
            self._cumulative._absorb_tree(self._open)
            self._open.drop_path_cache()  # a closed bucket is only read: its path cache is dead weight
            self._closed_folded += self._open.budget_folded
            self._closed.append((self._open_idx, self._open))
            self._closed_bytes += self._open.estimated_bytes
            self._open = CCT(self.metrics, self.max_nodes, self._open_cap)
        self._open_idx = idx
        self._open_end = (idx + 1) * self.bucket_s
        oldest = idx - self._n_buckets + 1
        closed = self._closed
        while closed and (closed[0][0] < oldest or
                          (self._closed_cap is not None and self._closed_bytes > self._closed_cap)):
            if closed[0][0] >= oldest:
                self._evicted += 1
            self._closed_bytes -= closed.popleft()[1].estimated_bytes

    def memory(self) -> dict[str, int]:
        """Estimated bytes held and what the byte budget cost: `budget_folded_nodes` (contexts
        folded into [other] by a tree's byte cap) and `evicted_buckets` (window buckets dropped
        before their horizon)."""
        cum, open_ = self._cumulative.estimated_bytes, self._open.estimated_bytes
        return {
            "budget_bytes": self.max_bytes or 0,
            "used_bytes": cum + open_ + self._closed_bytes,
            "cumulative_bytes": cum,
            "window_bytes": open_ + self._closed_bytes,
            "budget_folded_nodes": self._cumulative.budget_folded + self._closed_folded + self._open.budget_folded,
            "evicted_buckets": self._evicted,
        }

    def snapshot(
        self,
        window_s: float | None = None,
        meta: Mapping[str, Any] | None = None,
        unavailable: Iterable[str] = (),
        now: float | None = None,
    ) -> Snapshot:
        """Cumulative view (`window_s=None`) or the last `window_s` seconds, to a bucket."""
        self.flush()
        now = self._clock() if now is None else now
        self._advance(now, event=False)
        mem = self.memory()
        if mem["budget_folded_nodes"] or mem["evicted_buckets"]:   # what the user does not see
            meta = {**(meta or {}), "memory": mem}
        if window_s is None:
            if _empty(self._open):
                return self._cumulative.snapshot(meta, unavailable)
            view = self._cumulative.copy()
            view._absorb_tree(self._open)
            return view.snapshot(meta, unavailable)
        if not 0 < window_s <= self.horizon_s:
            raise ValueError(f"window_s must be in (0, horizon_s={self.horizon_s}], got {window_s}")
        # The 1e-9 keeps 0.3 / 0.1 == 2.9999999999999996 from asking for a fourth bucket.
        oldest = self._open_idx - math.ceil(window_s / self.bucket_s - 1e-9) + 1
        # the seconds the view covers, for rates and shares (analyzer/view.py reads window_s):
        # from its oldest bucket's start, or from the first event of a younger tree, to now
        start = max(oldest * self.bucket_s, now if self._first_t is None else self._first_t)
        meta = {**(meta or {}), "window_s": round(max(0.0, now - start), 6)}
        view = CCT(self.metrics, self.max_nodes)
        for idx, bucket in self._closed:
            if idx >= oldest:
                view._absorb_tree(bucket)
        view._absorb_tree(self._open)
        return view.snapshot(meta, unavailable)


def _empty(tree: CCT) -> bool:
    return tree.node_count == 1 and not any(col[0] for col in tree._cols)


def merge(a: Snapshot, b: Snapshot) -> Snapshot:
    """The sum of two snapshots, matched by path.

    Metrics: a's, then b's others. A metric is unavailable only if neither side measured it (a
    side without the metric counts as not measuring it). `folded_nodes` adds up; `meta` keeps
    the items both sides agree on. Associative and commutative (up to node numbering).
    """
    return _combine(a, b, 1)


def diff(a: Snapshot, b: Snapshot) -> Snapshot:
    """a - b, signed, matched by path; a metric unmeasured on either side is unavailable."""
    return _combine(a, b, -1)


def growth(later: Snapshot, earlier: Snapshot) -> Snapshot:
    """What one growing tree gained between two snapshots of it: `later` minus `earlier`. A metric
    is unavailable only where `later` does not measure it: the younger tree may not have measured
    it yet (a GPU collector that had reported nothing), and then it held none of it."""
    return _combine(later, earlier, -1, unavailable_of=later)


def _combine(a: Snapshot, b: Snapshot, sign: int, unavailable_of: Snapshot | None = None) -> Snapshot:
    metrics = a.metrics + tuple(m for m in b.metrics if m not in a.metrics)
    tree = CCT(metrics, max_nodes=None)
    tree._absorb_snapshot(a)
    tree._absorb_snapshot(b, sign)

    def unmeasured(s: Snapshot) -> set[str]:
        return set(s.unavailable) | (set(metrics) - set(s.metrics))

    if unavailable_of is not None:
        unavailable = unmeasured(unavailable_of)
    elif sign > 0:
        unavailable = unmeasured(a) & unmeasured(b)
    else:
        unavailable = unmeasured(a) | unmeasured(b)
    meta = {k: v for k, v in a.meta.items() if k in b.meta and b.meta[k] == v}
    return tree.snapshot(meta, unavailable)
