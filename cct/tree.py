"""The calling context tree: online aggregation of metric deltas by calling context.

Pure data, no privilege, no I/O, not thread-safe: one aggregation thread owns a tree and hands
immutable `Snapshot`s to everyone else.

Overhead: a path seen before costs one dict lookup (hashing the path tuple) plus one list add,
about what a plain `dict` counter keyed by the same tuple costs (0.9-1.1x, ~1.1 us per 20-frame
event on the 2-core VM; docs/benchmarks/cct.md). A new path
walks the tree once, one dict lookup per frame. Memory grows with the number of distinct
contexts, never with the number of events, and is capped by `max_nodes`.

Layout: frames are interned to ints; node n is (parents[n], node_frame[n]); exclusive values
live in one list per metric, indexed by node. Inclusive values are only computed in snapshots.

Node cap and folding: when an insertion pushes the node count over `max_nodes`, the coldest
contexts are folded until the tree is back to 90% of the cap, so that folding (O(n log n)) runs
once per 10% of the cap worth of new contexts, not on every new one.
- The weight of a node is the sum over metrics of its inclusive value as a fraction of that
  metric's total: metrics have different units (ns, counts, bytes), so each is normalised to its
  share before adding. Coldest = least weight; among equals the newest node goes first.
- A folded subtree is replaced by its parent's `[other]` child (created when needed), which
  receives the sum of every value in the subtree, so every metric's total is conserved and the
  folded values stay attributed to the deepest context that survives. Per-parent `[other]` keeps
  "somewhere under train_step" instead of losing all context into one global bucket.
- Folding goes strictly coldest first. The first fold under a parent creates its `[other]`, so
  it saves a node only if the subtree had two or more; the loop goes on until enough are saved.
- `folded_nodes` counts every node removed by folding over the tree's life.
- Long-lived hot contexts win against newcomers, whose weight starts small; windowed views
  (window.py) build on per-second trees, so a new phase of a job shows up there.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from .frames import OTHER, ROOT, Frame
from .snapshot import Snapshot

METRICS = (
    "gpu_time_ns",
    "kernel_count",
    "launch_count",
    "api_cpu_ns",
    "sync_wait_ns",
    "cpu_samples",
    "alloc_bytes",
    "copy_bytes",
)

_FOLD_TO = 0.9


class CCT:
    """A mutable calling context tree; see the module docstring for layout and folding."""

    def __init__(self, metrics: Sequence[str] = METRICS, max_nodes: int | None = 100_000) -> None:
        metrics = tuple(metrics)
        if not metrics or len(set(metrics)) != len(metrics):
            raise ValueError(f"metrics must be a non-empty sequence of distinct names, got {metrics}")
        if max_nodes is not None and max_nodes < 2:
            raise ValueError("max_nodes must be at least 2 (the root and one [other] node), or None")
        self.metrics = metrics
        self.max_nodes = max_nodes
        self._frames: list[Frame] = [ROOT]
        self._frame_ids: dict[Frame, int] = {ROOT: 0}
        self._parents: list[int] = [-1]
        self._node_frame: list[int] = [0]
        self._child: dict[tuple[int, int], int] = {}
        self._excl: dict[str, list[int]] = {m: [0] for m in metrics}
        self._cols = list(self._excl.values())
        # Path tuple -> leaf node: the hot path. Keys are built from interned frames so the
        # cache never pins the caller's frame objects; at most one entry per node (a trie maps
        # distinct paths to distinct nodes), and it is emptied whenever folding renumbers nodes.
        self._leaf_of: dict[tuple[Frame, ...], int] = {}
        self._folded = 0

    @property
    def node_count(self) -> int:
        return len(self._parents)

    @property
    def folded_nodes(self) -> int:
        return self._folded

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

    def _add_new(self, path: tuple[Frame, ...], deltas: Mapping[str, int]) -> None:
        for metric in deltas:
            if metric not in self._excl:
                raise self._unknown_metric(metric)
        node = 0
        frame_ids, child = self._frame_ids, self._child
        for frame in path:
            fid = frame_ids.get(frame)
            if fid is None:
                fid = self._intern(frame)
            nxt = child.get((node, fid))
            node = self._new_node(node, fid) if nxt is None else nxt
        for metric, value in deltas.items():
            self._excl[metric][node] += value
        if self.max_nodes is not None and len(self._parents) > self.max_nodes:
            self._fold()
        else:
            frames = self._frames
            self._leaf_of[tuple(frames[frame_ids[f]] for f in path)] = node

    def _intern(self, frame: Frame) -> int:
        if not isinstance(frame, Frame):
            raise TypeError(f"a path holds Frame objects, got {frame!r}")
        fid = len(self._frames)
        self._frames.append(frame)
        self._frame_ids[frame] = fid
        return fid

    def _new_node(self, parent: int, fid: int) -> int:
        node = len(self._parents)
        self._parents.append(parent)
        self._node_frame.append(fid)
        for col in self._cols:
            col.append(0)
        self._child[(parent, fid)] = node
        return node

    def _unknown_metric(self, metric: str) -> KeyError:
        return KeyError(f"unknown metric {metric!r}; this tree records {self.metrics}")

    def _absorb(
        self,
        frames: Sequence[Frame],
        parents: Sequence[int],
        exclusive: Mapping[str, Sequence[int]],
        *,
        sign: int = 1,
        folded_nodes: int = 0,
    ) -> None:
        """Add another tree, given as per-node frames, parents and exclusive columns, by path.

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
            nxt = child.get((parent, fid))
            remap[node] = self._new_node(parent, fid) if nxt is None else nxt
        for metric, theirs in exclusive.items():
            mine = self._excl.get(metric)
            if mine is None:
                continue
            for node, value in enumerate(theirs):
                if value:
                    mine[remap[node]] += sign * value
        self._folded += sign * folded_nodes
        if self.max_nodes is not None and len(self._parents) > self.max_nodes:
            self._fold()

    def _absorb_tree(self, other: CCT, sign: int = 1) -> None:
        frames = other._frames
        self._absorb(
            [frames[f] for f in other._node_frame],
            other._parents,
            other._excl,
            sign=sign,
            folded_nodes=other._folded,
        )

    def _absorb_snapshot(self, snap: Snapshot, sign: int = 1) -> None:
        # Reads the snapshot's tuples directly: going through frame_of()/exclusive() per node
        # would cost a method call per node and metric.
        self._absorb(snap._frames, snap._parents, snap._excl, sign=sign, folded_nodes=snap.folded_nodes)

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
        )

    def copy(self) -> CCT:
        """An independent copy (C-speed list and dict copies; the path cache starts empty)."""
        new = CCT(self.metrics, self.max_nodes)
        new._frames = self._frames.copy()
        new._frame_ids = self._frame_ids.copy()
        new._parents = self._parents.copy()
        new._node_frame = self._node_frame.copy()
        new._child = self._child.copy()
        new._excl = {m: col.copy() for m, col in self._excl.items()}
        new._cols = list(new._excl.values())
        new._folded = self._folded
        return new

    # -- folding -------------------------------------------------------------------------

    def _fold(self) -> None:
        assert self.max_nodes is not None
        target = max(2, int(self.max_nodes * _FOLD_TO))
        parents, cols = self._parents, self._cols
        n_nodes = len(parents)

        weight = [0.0] * n_nodes
        for col in cols:
            total = sum(map(abs, col))
            if total:
                for node, value in enumerate(col):
                    if value:
                        weight[node] += abs(value) / total
        for node in range(n_nodes - 1, 0, -1):
            weight[parents[node]] += weight[node]
        children: list[list[int]] = [[] for _ in range(n_nodes)]
        for node in range(1, n_nodes):
            children[parents[node]].append(node)

        other_fid = self._frame_ids.get(OTHER)
        if other_fid is None:
            other_fid = self._intern(OTHER)
        node_frame = self._node_frame
        # Descendants never weigh more than their ancestors, so ascending weight (newest
        # first among equals, and children are newer than parents) folds leaves before parents.
        order = sorted(
            (n for n in range(1, n_nodes) if node_frame[n] != other_fid),
            key=lambda n: (weight[n], -n),
        )
        gone = bytearray(n_nodes)
        live = n_nodes

        def fold(node: int) -> int:
            """Fold node's subtree into its parent's [other]; returns how many nodes that saves."""
            parent = parents[node]
            other = self._child.get((parent, other_fid))
            created = 0
            if other is None:
                other = self._new_node(parent, other_fid)
                gone.append(0)
                children.append([])
                children[parent].append(other)
                created = 1
            removed = 0
            stack = [node]
            while stack:
                n = stack.pop()
                if gone[n]:
                    continue
                gone[n] = 1
                removed += 1
                for col in cols:
                    if col[n]:
                        col[other] += col[n]
                        col[n] = 0
                stack.extend(children[n])
            del self._child[(parent, node_frame[node])]
            self._folded += removed
            return removed - created

        for node in order:
            if live <= target:
                break
            if not gone[node]:
                live -= fold(node)
        self._compact(gone)

    def _compact(self, gone: bytearray) -> None:
        """Renumber the surviving nodes (keeping parent < child) and drop unused frames."""
        keep = [n for n in range(len(self._parents)) if not gone[n]]
        new_id = [-1] * len(self._parents)
        for i, n in enumerate(keep):
            new_id[n] = i
        old_frames = self._frames
        frames: list[Frame] = []
        frame_ids: dict[Frame, int] = {}
        node_frame: list[int] = []
        parents: list[int] = []
        child: dict[tuple[int, int], int] = {}
        for i, n in enumerate(keep):
            frame = old_frames[self._node_frame[n]]
            fid = frame_ids.get(frame)
            if fid is None:
                fid = frame_ids[frame] = len(frames)
                frames.append(frame)
            parent = new_id[self._parents[n]] if n else -1
            node_frame.append(fid)
            parents.append(parent)
            if n:
                child[(parent, fid)] = i
        self._frames, self._frame_ids = frames, frame_ids
        self._node_frame, self._parents, self._child = node_frame, parents, child
        self._excl = {m: [col[n] for n in keep] for m, col in self._excl.items()}
        self._cols = list(self._excl.values())
        self._leaf_of = {}
