"""Immutable snapshot of a calling context tree, safe to hand to other threads.

Pure data, no privilege, no I/O. Everything is held in tuples built when the snapshot is taken
(and `meta` is a private deep copy), so a snapshot shares no mutable state with the tree it came
from. Building one costs O(nodes x metrics): inclusive values are summed here, once, instead of
being maintained on every insertion.

Node ids are dense ints, 0 is the root, and a parent's id is always smaller than its children's,
so a reverse scan over ids visits children before parents.
"""

from __future__ import annotations

import copy
import heapq
import operator
from itertools import accumulate, islice
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from stacklens.cct.frames import Frame


def _by_count(item: tuple[int, int]) -> tuple[int, int]:
    return -item[1], item[0]


class Snapshot:
    """A frozen CCT: per-node frame, parent, exclusive and inclusive metric values.

    Normally made by `CCT.snapshot()`, `merge`, `diff` or `export.from_json`. The constructor
    trusts its arguments to describe a tree (node 0 the root with parent -1, `parents[n] < n`);
    `from_json` checks that for untrusted input.
    """

    __slots__ = (
        "metrics",
        "node_count",
        "unavailable",
        "folded_nodes",
        "meta",
        "_frames",
        "_parents",
        "_children",
        "_child_start",
        "_excl",
        "_incl",
        "_threads",
    )

    root = 0

    def __init__(
        self,
        metrics: Sequence[str],
        frames: Sequence[Frame],
        parents: Sequence[int],
        exclusive: Mapping[str, Sequence[int]],
        *,
        unavailable: frozenset[str] | set[str] | Sequence[str] = (),
        folded_nodes: int = 0,
        meta: Mapping[str, Any] | None = None,
        threads: Mapping[str, Mapping[int, Mapping[int, int]]] | None = None,
    ) -> None:
        """`threads`: metric -> node -> {tid: count}, the part of a node's exclusive value each
        thread had (CCT.add_sample); what they leave of it is "[other threads]"."""
        metrics = tuple(metrics)
        n_nodes = len(parents)
        if len(frames) != n_nodes or any(len(exclusive[m]) != n_nodes for m in metrics):
            raise ValueError("frames, parents and every exclusive column need one entry per node")
        unavailable = frozenset(unavailable)
        if not unavailable <= set(metrics):
            raise ValueError(f"unavailable metrics {sorted(unavailable - set(metrics))} are not in {metrics}")
        parents = tuple(parents)
        excl = {m: tuple(exclusive[m]) for m in metrics}

        # Children as one array grouped by parent plus offsets, rather than a list per node:
        # allocating 100k small containers would set off several full garbage collections.
        # Breadth-first numbering (what `export.from_columnar` reads) is already grouped: no sort.
        if all(map(operator.le, parents, islice(parents, 1, None))):
            by_parent: Sequence[int] = range(1, n_nodes)
        else:
            by_parent = sorted(range(1, n_nodes), key=parents.__getitem__)  # stable: ids ascend
        counts = [0] * (n_nodes + 1)
        for parent in islice(parents, 1, None):
            counts[parent + 1] += 1

        incl: dict[str, tuple[int, ...]] = {}
        for m, col in excl.items():
            if not any(col):
                incl[m] = col
                continue
            acc = list(col)
            # children have larger ids than their parents: one reverse pass adds every node to
            # its parent after its own children were added to it
            for parent, value in zip(reversed(parents), islice(reversed(acc), max(0, n_nodes - 1))):
                acc[parent] += value
            incl[m] = tuple(acc)

        setattr_ = object.__setattr__
        setattr_(self, "metrics", metrics)
        setattr_(self, "node_count", n_nodes)
        setattr_(self, "unavailable", unavailable)
        setattr_(self, "folded_nodes", folded_nodes)
        setattr_(self, "meta", copy.deepcopy(dict(meta or {})))
        setattr_(self, "_frames", tuple(frames))
        setattr_(self, "_parents", parents)
        setattr_(self, "_children", tuple(by_parent))
        setattr_(self, "_child_start", tuple(accumulate(counts)))
        setattr_(self, "_excl", excl)
        setattr_(self, "_incl", incl)
        # largest first, then by tid: the same content reads the same whatever the insertion order
        setattr_(self, "_threads", {
            m: {n: tuple(sorted(t.items(), key=_by_count)) for n, t in by_node.items() if t}
            for m, by_node in (threads or {}).items() if m in excl and by_node
        })

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError("Snapshot is immutable")

    def __delattr__(self, name: str) -> None:
        raise AttributeError("Snapshot is immutable")

    # -- structure -----------------------------------------------------------------------

    def frame_of(self, node: int) -> Frame:
        return self._frames[node]

    def parent(self, node: int) -> int:
        """The parent's id; -1 for the root."""
        return self._parents[node]

    def children(self, node: int) -> tuple[int, ...]:
        """Child ids in ascending order."""
        start = self._child_start
        return self._children[start[node] : start[node + 1]]

    def path(self, node: int) -> tuple[Frame, ...]:
        """Frames from the outermost caller down to `node`; the root itself is not included."""
        frames = []
        parents = self._parents
        while node > 0:
            frames.append(self._frames[node])
            node = parents[node]
        frames.reverse()
        return tuple(frames)

    def find(self, labels: Sequence[str]) -> int | None:
        """The node reached by following frame labels from the root, or None."""
        node = 0
        for label in labels:
            for child in self.children(node):
                if self._frames[child].label() == label:
                    node = child
                    break
            else:
                return None
        return node

    # -- values --------------------------------------------------------------------------

    def exclusive(self, node: int, metric: str) -> int:
        return self._column(self._excl, metric)[node]

    def inclusive(self, node: int, metric: str) -> int:
        return self._column(self._incl, metric)[node]

    def total(self, metric: str) -> int:
        return self._column(self._incl, metric)[0]

    def exclusive_column(self, metric: str) -> tuple[int, ...]:
        """Every node's exclusive `metric`, indexed by node: for renderers that read them all
        (one tuple, not a call per value)."""
        return self._column(self._excl, metric)

    @property
    def threaded(self) -> frozenset[str]:
        """The metrics with a breakdown by thread."""
        return frozenset(self._threads)

    def threads(self, node: int, metric: str) -> tuple[tuple[int, int], ...]:
        """(tid, count) of the threads that had part of `node`'s exclusive `metric`, largest
        first; the rest of the value is "[other threads]" (all of it without a breakdown)."""
        return self._threads.get(metric, {}).get(node, ())

    def iter_paths(self) -> Iterator[tuple[tuple[Frame, ...], dict[str, int]]]:
        """(path, {metric: exclusive value}) for every node with a non-zero exclusive value."""
        metrics = self.metrics
        columns = [self._excl[m] for m in metrics]
        for node, values in enumerate(zip(*columns)):
            if any(values):
                yield self.path(node), dict(zip(metrics, values))

    def top(self, metric: str, k: int, exclusive: bool = True) -> list[int]:
        """Ids of the (at most) k non-root nodes with the largest non-zero values, largest first."""
        col = self._column(self._excl if exclusive else self._incl, metric)
        nodes = (n for n in range(1, self.node_count) if col[n])
        return heapq.nlargest(k, nodes, key=lambda n: (col[n], -n))

    def _column(self, columns: dict[str, tuple[int, ...]], metric: str) -> tuple[int, ...]:
        try:
            return columns[metric]
        except KeyError:
            raise KeyError(f"unknown metric {metric!r}; this snapshot has {self.metrics}") from None

    # -- comparison ----------------------------------------------------------------------

    def _content(self) -> tuple[object, ...]:
        # Node numbering and zero-valued structure depend on insertion order; what a profile
        # says is which paths carry which values.
        paths = {path: {m: v for m, v in values.items() if v} for path, values in self.iter_paths()}
        threads = {(m, self.path(n)): t for m, by_node in self._threads.items() for n, t in by_node.items()}
        return (frozenset(self.metrics), self.unavailable, self.folded_nodes, self.meta, paths, threads)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Snapshot):
            return NotImplemented
        return self._content() == other._content()

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        totals = ", ".join(f"{m}={self.total(m)}" for m in self.metrics if self.total(m))
        return f"<Snapshot nodes={self.node_count} folded={self.folded_nodes} {totals}>"
