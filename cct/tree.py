"""The calling context tree: online aggregation of metric deltas by calling context.

Pure data, no privilege, no I/O, not thread-safe: one aggregation thread owns a tree and hands
immutable `Snapshot`s to everyone else.

Overhead: a path seen before costs one dict lookup (hashing the path tuple) plus one list add,
about what a plain `dict` counter keyed by the same tuple costs (~1 us per 20-frame event on the
2-core VM; docs/benchmarks/cct.md). A new path walks the tree once, one dict lookup per frame.
Memory grows with the number of distinct contexts, never with the number of events, and is
capped by `max_nodes`.

Layout: frames are interned to ints; node n is (parents[n], node_frame[n]); exclusive values
live in one list per metric, indexed by node. Inclusive values are only computed in snapshots.

Node cap: the tree never holds more than `max_nodes` nodes.
- When a new context does not fit, its values go to the nearest `[other]` node on its path
  (deepest first; the path cache remembers that), and it counts as turned away.
- Once max_nodes/10 distinct contexts have been turned away (or no `[other]` is on the path and
  there is no room for one), the coldest contexts are folded into `[other]` nodes until the tree
  is back to 90% of the cap, which makes room for newcomers (fold.py: which contexts go, where
  their values go, what it costs). Without the turn-away step, contexts folded away came straight
  back and were folded again: with 20,000 live contexts over a 50,000-node cap that cost 165 us
  per event; with it, 16 us.
- `folded_nodes` counts the nodes removed by folding plus the nodes a turned-away context would
  have needed (counted again if it is turned away again after a fold).

Byte cap (`max_bytes`, issue 17): nodes are not all the memory. Frame strings come from the
target (a hostile one sent unique 8 KiB names: 5.4 GiB in 74 s under a node cap of 100k per tree),
so the tree also keeps an estimate of its bytes (`estimated_bytes`: per node, per interned frame
with its strings' `sys.getsizeof`, per path-cache entry; constants below, checked against
tracemalloc by tests/unit/test_cct_budget.py). Past `max_bytes` the coldest contexts are folded,
the same fold as the node cap, until the estimate is back to 90% of it; `budget_folded` counts the
nodes that went. Totals are conserved as with the node cap. Frame objects shared between trees
are counted in each, so the estimate errs high.

Threads (issue 22): `add_sample(path, metric, tid)` also counts the value by thread, per node, in
a bounded breakdown (threads.py).
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Mapping, Sequence

from stacklens.cct import metrics as _metrics
from stacklens.cct.fold import FOLD_TO, compact, fold_coldest
from stacklens.cct.frames import OTHER, ROOT, Frame
from stacklens.cct.snapshot import Snapshot
# re-exported (`__all__`): the join and tests read MAX_THREADS here
from stacklens.cct.threads import MAX_THREADS, count_threads, threads_bytes

METRICS = _metrics.DEFAULT  # the default columns; every metric is declared in cct/metrics.py

# Estimated bytes (64-bit CPython 3.10-3.13) of what a tree holds, for `max_bytes`; threads.py
# has those of the thread breakdowns.
NODE_BYTES = 200    # parents/node_frame slots, a _child entry with its int key and value, cell ints
CELL_BYTES = 8      # a node's slot in each metric column
FRAME_BYTES = 190   # a Frame tuple, its _frames slot and _frame_ids entry (its strings apart)
PATH_BYTES = 150    # a _leaf_of entry: dict slot, tuple header, value; 8 more per frame of the path


def frame_bytes(frame: Frame) -> int:
    """Estimated bytes of one interned frame, its name and file strings included."""
    return FRAME_BYTES + sys.getsizeof(frame.name) + sys.getsizeof(frame.file)


__all__ = ["CCT", "METRICS", "MAX_THREADS", "NODE_BYTES", "CELL_BYTES", "FRAME_BYTES", "PATH_BYTES", "frame_bytes"]


class CCT:
    """A mutable calling context tree; see the module docstring for layout and caps, fold.py for
    folding and threads.py for the breakdown by thread."""

    def __init__(self, metrics: Sequence[str] = METRICS, max_nodes: int | None = 100_000,
                 max_bytes: int | None = None) -> None:
        metrics = tuple(metrics)
        if not metrics or len(set(metrics)) != len(metrics):
            raise ValueError(f"metrics must be a non-empty sequence of distinct names, got {metrics}")
        if max_nodes is not None and max_nodes < 2:
            raise ValueError("max_nodes must be at least 2 (the root and one [other] node), or None")
        if max_bytes is not None and max_bytes < 1:
            raise ValueError("max_bytes must be positive, or None")
        self.metrics = metrics
        self.max_nodes = max_nodes
        self.max_bytes = max_bytes
        self._node_bytes = NODE_BYTES + CELL_BYTES * len(metrics)
        self._bytes = self._node_bytes + frame_bytes(ROOT)   # nodes and frames
        self._path_bytes = 0                                  # the path cache
        self.budget_folded = 0   # nodes folded because of max_bytes
        self._frames: list[Frame] = [ROOT]
        self._frame_ids: dict[Frame, int] = {ROOT: 0}
        self._parents: list[int] = [-1]
        self._node_frame: list[int] = [0]
        # (parent, frame id) -> child, keyed by the int parent << 32 | frame id: an int key
        # hashes faster than a tuple, takes half the memory and is no work for the garbage
        # collector.
        self._child: dict[int, int] = {}
        self._excl: dict[str, list[int]] = {m: [0] for m in metrics}
        self._cols = list(self._excl.values())
        # Path tuple -> the node that takes its values: the hot path. Keys of paths in the tree
        # are built from interned frames, so the cache never pins the caller's frame objects.
        # Size: one entry per node (a trie maps distinct paths to distinct nodes) plus at most
        # max_nodes/10 turned-away paths, which every fold drops.
        self._leaf_of: dict[tuple[Frame, ...], int] = {}
        self._folded = 0
        self._turned_away = 0  # distinct contexts charged to [other] since the last fold
        # metric -> node -> {tid: count}: the values of add_sample by thread (threads.py)
        self._threads: dict[str, dict[int, dict[int, int]]] = {}

    @property
    def node_count(self) -> int:
        return len(self._parents)

    @property
    def folded_nodes(self) -> int:
        return self._folded

    @property
    def estimated_bytes(self) -> int:
        """What the tree holds, estimated (see the module docstring)."""
        return self._bytes + self._path_bytes

    def drop_path_cache(self) -> None:
        """Forget the path cache (a tree that is only read from now on: a closed window bucket)."""
        self._leaf_of = {}
        self._path_bytes = 0

    # -- insertion -----------------------------------------------------------------------

    def add(self, path: tuple[Frame, ...], metric: str, value: int) -> None:
        """Add `value` to `metric` of the context `path` (outermost frame first)."""
        leaf = self._leaf_of.get(path)
        if leaf is None:
            self._add_new(path, {metric: value})
            return
        try:
            self._excl[metric][leaf] += value
        except KeyError:
            raise self._unknown_metric(metric) from None

    def add_many(self, path: tuple[Frame, ...], deltas: Mapping[str, int]) -> None:
        """Add several metric deltas to one context; all or nothing if a metric is unknown."""
        leaf = self._leaf_of.get(path)
        if leaf is None:
            self._add_new(path, deltas)
            return
        excl = self._excl
        for metric, value in deltas.items():
            col = excl.get(metric)
            if col is None:
                for done, undo in deltas.items():
                    if done == metric:
                        break
                    excl[done][leaf] -= undo
                raise self._unknown_metric(metric)
            col[leaf] += value

    def add_row(self, path: tuple[Frame, ...], values: Sequence[int]) -> None:
        """Add `values[i]` to metric `self.metrics[i]` of the context `path`; zeros are skipped and
        items past the last metric ignored. One path lookup for all metrics: what
        `WindowedCCT.flush` applies per staged path."""
        leaf = self._leaf_of.get(path)
        if leaf is None:
            self._add_new(path, {m: v for m, v in zip(self.metrics, values) if v})
            return
        for col, v in zip(self._cols, values):
            if v:
                col[leaf] += v

    def add_sample(self, path: tuple[Frame, ...], metric: str, tid: int, value: int = 1) -> None:
        """`add(path, metric, value)`, also counted for thread `tid` (0: not known); see the
        module docstring."""
        leaf = self._leaf_of.get(path)
        if leaf is None:
            self._add_new(path, {metric: value})
            leaf = self._leaf_of.get(path)
            if leaf is None:    # folded away by the byte cap just now: counted, not by thread
                return
        else:
            try:
                self._excl[metric][leaf] += value
            except KeyError:
                raise self._unknown_metric(metric) from None
        if tid <= 0:
            return
        by_node = self._threads.get(metric)
        if by_node is None:
            by_node = self._threads[metric] = {}
        threads = by_node.get(leaf)
        if threads is not None and tid in threads:
            threads[tid] += value
        else:
            self._bytes += count_threads(by_node, leaf, ((tid, value),))

    def _add_new(self, path: tuple[Frame, ...], deltas: Mapping[str, int]) -> None:
        for metric in deltas:
            if metric not in self._excl:
                raise self._unknown_metric(metric)
        node, key = self._place(path)
        for metric, value in deltas.items():
            self._excl[metric][node] += value
        self._leaf_of[key] = node
        self._path_bytes += PATH_BYTES + 8 * len(key)
        if self.max_bytes is not None and self._bytes + self._path_bytes > self.max_bytes:
            self._fold_bytes()

    def _place(self, path: tuple[Frame, ...]) -> tuple[int, tuple[Frame, ...]]:
        """The node that takes `path`'s values (created if there is room), and its cache key."""
        frame_ids, child, cap = self._frame_ids, self._child, self.max_nodes
        node = 0
        for depth, frame in enumerate(path):
            fid = frame_ids.get(frame)
            if fid is None:
                fid = self._intern(frame)
            nxt = child.get(node << 32 | fid)
            if nxt is None:
                missing = len(path) - depth
                if cap is not None and len(self._parents) + missing > cap:
                    return self._turn_away(path, node, missing)
                nxt = self._new_node(node, fid)
            node = nxt
        frames = self._frames
        return node, tuple(frames[frame_ids[f]] for f in path)

    def _turn_away(self, path: tuple[Frame, ...], node: int, missing: int) -> tuple[int, tuple[Frame, ...]]:
        """The tree is full: charge `path` to the nearest `[other]` on it (deepest first), or
        fold first if enough contexts were turned away (see the module docstring)."""
        assert self.max_nodes is not None
        if self._turned_away >= max(1, self.max_nodes // 10):
            self._fold()
            return self._place(path)
        other_fid = self._frame_ids.get(OTHER)
        if other_fid is None:
            other_fid = self._intern(OTHER)
        ancestor = node
        while ancestor >= 0:
            other = self._child.get(ancestor << 32 | other_fid)
            if other is not None:
                break
            ancestor = self._parents[ancestor]
        else:
            if len(self._parents) >= self.max_nodes:
                # Make room for one [other]; if even that fails everything went into the
                # root's [other], which is on every path.
                self._fold(min(self.max_nodes - 1, max(2, int(self.max_nodes * FOLD_TO))))
                return self._place(path)
            other = self._new_node(node, other_fid)
        self._turned_away += 1
        self._folded += missing
        # The caller's tuple is the key: the next fold drops it, as there may be room then.
        return other, path

    def _intern(self, frame: Frame) -> int:
        if not isinstance(frame, Frame):
            raise TypeError(f"a path holds Frame objects, got {frame!r}")
        fid = len(self._frames)
        self._frames.append(frame)
        self._frame_ids[frame] = fid
        self._bytes += frame_bytes(frame)
        return fid

    def _new_node(self, parent: int, fid: int) -> int:
        node = len(self._parents)
        self._parents.append(parent)
        self._node_frame.append(fid)
        for col in self._cols:
            col.append(0)
        self._child[parent << 32 | fid] = node
        self._bytes += self._node_bytes
        return node

    def _unknown_metric(self, metric: str) -> KeyError:
        return KeyError(f"unknown metric {metric!r}; this tree records {self.metrics}")

    def _absorb(
        self,
        frames: Sequence[Frame],
        parents: Sequence[int],
        exclusive: Mapping[str, Sequence[int]],
        threads: Mapping[str, Mapping[int, Mapping[int, int] | Iterable[tuple[int, int]]]],
        *,
        sign: int = 1,
        folded_nodes: int = 0,
    ) -> None:
        """Add another tree, given as per-node frames, parents, exclusive columns and thread
        breakdowns (metric -> node -> {tid: count} or (tid, count) pairs), by path.

        Metrics this tree does not record are ignored. Used to merge buckets and snapshots.
        """
        remap = [0] * len(parents)
        frame_ids, child = self._frame_ids, self._child
        for node in range(1, len(parents)):
            frame = frames[node]
            fid = frame_ids.get(frame)
            if fid is None:
                fid = self._intern(frame)
            parent = remap[parents[node]]
            nxt = child.get(parent << 32 | fid)
            remap[node] = self._new_node(parent, fid) if nxt is None else nxt
        for metric, theirs in exclusive.items():
            mine = self._excl.get(metric)
            if mine is None:
                continue
            for node, value in enumerate(theirs):
                if value:
                    mine[remap[node]] += sign * value
        for metric, by_node in threads.items():
            if metric in self._excl:
                to = self._threads.setdefault(metric, {})
                for node, counts in by_node.items():
                    self._bytes += count_threads(to, remap[node], counts.items() if isinstance(counts, dict) else counts, sign)
        self._folded += sign * folded_nodes
        if self.max_nodes is not None and len(self._parents) > self.max_nodes:
            self._fold()
        if self.max_bytes is not None and self.estimated_bytes > self.max_bytes:
            self._fold_bytes()

    def _absorb_tree(self, other: CCT, sign: int = 1) -> None:
        frames = other._frames
        self._absorb(
            [frames[f] for f in other._node_frame],
            other._parents,
            other._excl,
            other._threads,
            sign=sign,
            folded_nodes=other._folded,
        )

    def _absorb_snapshot(self, snap: Snapshot, sign: int = 1) -> None:
        # Reads the snapshot's tuples directly: going through frame_of()/exclusive() per node
        # would cost a method call per node and metric.
        self._absorb(snap._frames, snap._parents, snap._excl, snap._threads, sign=sign,
                     folded_nodes=snap.folded_nodes)

    # -- output --------------------------------------------------------------------------

    def snapshot(self, meta: Mapping[str, object] | None = None, unavailable: Iterable[str] = ()) -> Snapshot:
        """An immutable copy with inclusive values; `unavailable` names metrics not measured."""
        frames = self._frames
        return Snapshot(
            self.metrics,
            [frames[f] for f in self._node_frame],
            self._parents,
            self._excl,
            unavailable=frozenset(unavailable),
            folded_nodes=self._folded,
            meta=meta,
            threads=self._threads,
        )

    def copy(self) -> CCT:
        """An independent copy (C-speed list and dict copies; the path cache starts empty)."""
        new = CCT(self.metrics, self.max_nodes, self.max_bytes)
        new._frames = self._frames.copy()
        new._frame_ids = self._frame_ids.copy()
        new._parents = self._parents.copy()
        new._node_frame = self._node_frame.copy()
        new._child = self._child.copy()
        new._excl = {m: col.copy() for m, col in self._excl.items()}
        new._cols = list(new._excl.values())
        new._threads = {m: {n: t.copy() for n, t in by_node.items()} for m, by_node in self._threads.items()}
        new._folded = self._folded
        new._bytes = self._bytes
        new.budget_folded = self.budget_folded
        return new

    # -- folding -------------------------------------------------------------------------

    def _fold_bytes(self) -> None:
        """Past max_bytes: fold the coldest contexts until the estimate is at most 90% of it. The
        fold counts nodes, so its target is the node count scaled by the bytes to shed; a few
        rounds because strings are not spread evenly over nodes."""
        assert self.max_bytes is not None
        goal = self.max_bytes * FOLD_TO
        before = self._folded
        for _ in range(4):
            total, n_nodes = self.estimated_bytes, len(self._parents)
            if total <= goal or n_nodes <= 2:
                break
            self._fold(max(2, min(n_nodes - 1, int(n_nodes * goal / total))))
        self.budget_folded += self._folded - before

    def _fold(self, target: int | None = None) -> None:
        """Fold the coldest subtrees until at most `target` nodes (default: 90% of the cap) remain,
        or nothing is left to fold (fold.py), and renumber the nodes left."""
        if target is None:
            assert self.max_nodes is not None
            target = max(2, int(self.max_nodes * FOLD_TO))
        other_fid = self._frame_ids.get(OTHER)
        if other_fid is None:
            other_fid = self._intern(OTHER)
        gone, removed = fold_coldest(self._parents, self._node_frame, self._cols, self._child,
                                     self._threads.values(), other_fid, target, self._new_node)
        self._folded += removed
        (self._frames, self._frame_ids, self._parents, self._node_frame, self._child, self._excl,
         self._leaf_of, self._threads) = compact(gone, other_fid, self._frames, self._parents,
                                                 self._node_frame, self._excl, self._leaf_of, self._threads)
        self._cols = list(self._excl.values())
        self._turned_away = 0
        self._bytes = (self._node_bytes * len(self._parents) + sum(map(frame_bytes, self._frames))
                       + threads_bytes(self._threads))
        self._path_bytes = PATH_BYTES * len(self._leaf_of) + 8 * sum(map(len, self._leaf_of))
