"""Folding: how a full calling context tree makes room, on the tree's own lists (tree.py's layout).

Pure data, no privilege, no I/O. `CCT` folds when its node cap or byte cap is passed (tree.py
says when); a fold removes the coldest contexts until the tree is back to FOLD_TO (90%) of the
cap. Cost: O(n log n) in the tree's nodes (about 0.1 s for 50k nodes), once per max_nodes/10
newcomers, not for each.
- The weight of a node is the sum over metrics of its inclusive value as a fraction of that
  metric's total: metrics have different units (ns, counts, bytes), so each is normalised to its
  share before adding. Coldest = least weight; among equals the newest node goes first.
- A folded subtree is replaced by its parent's `[other]` child (created when needed), which
  receives the sum of every value in the subtree (and its thread counts, threads.py), so every
  metric's total is conserved and the folded values stay attributed to the deepest context that
  survives. Per-parent `[other]` keeps "somewhere under train_step" instead of losing all context
  into one global bucket.
- Folding goes strictly coldest first. The first fold under a parent creates its `[other]`, so
  it saves a node only if the subtree had two or more; the loop goes on until enough are saved.
- Weight is cumulative, so long-lived hot contexts win against newcomers, whose weight starts
  small; windowed views (window.py) build on per-second trees, where a new phase of a job shows.
- Afterwards the survivors are renumbered (`compact`), keeping the path cache entries of
  surviving contexts.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterable, Mapping, Sequence
from itertools import accumulate, compress, repeat
from typing import NamedTuple

from stacklens.cct.frames import Frame
from stacklens.cct.threads import count_threads

FOLD_TO = 0.9  # a fold brings the tree back to this share of its cap


def weights(parents: Sequence[int], cols: Iterable[Sequence[int]]) -> list[float]:
    """Each node's weight: the sum over metrics of its inclusive value's share of the total."""
    n_nodes = len(parents)
    weight = [0.0] * n_nodes
    for col in cols:
        total = sum(map(abs, col))
        if total:
            shares = map(operator.truediv, map(abs, col), repeat(total))
            weight = list(map(operator.add, weight, shares))
    for node in range(n_nodes - 1, 0, -1):
        weight[parents[node]] += weight[node]
    return weight


def fold_coldest(
    parents: list[int],
    node_frame: list[int],
    cols: list[list[int]],
    child: dict[int, int],
    threads: Iterable[dict[int, dict[int, int]]],
    other_fid: int,
    target: int,
    new_node: Callable[[int, int], int],
) -> tuple[bytearray, int]:
    """Fold the coldest subtrees into their parent's `[other]` until at most `target` nodes
    remain, or nothing is left to fold. `new_node(parent, fid)` is the tree's: it appends an
    `[other]` node to the lists. Returns which nodes are gone (by id; `[other]` nodes made here
    are kept) and how many went; the lists still hold them until `compact`."""
    n_nodes = len(parents)
    weight = weights(parents, cols)
    # Children grouped by parent plus offsets, not a list per node (which would set off
    # full garbage collections); [other] nodes made by this fold are in `new_other`.
    by_parent = sorted(range(1, n_nodes), key=parents.__getitem__)
    counts = [0] * (n_nodes + 1)
    for parent in parents[1:]:
        counts[parent + 1] += 1
    start = list(accumulate(counts))
    new_other: dict[int, int] = {}
    # Descendants never weigh more than their ancestors, so ascending weight (newest
    # first among equals, and children are newer than parents) folds leaves before parents.
    # A stable sort of descending ids gives that order without building a key per node.
    order = sorted(range(n_nodes - 1, 0, -1), key=weight.__getitem__)
    gone = bytearray(n_nodes)
    thread_counts = list(threads)

    def fold(node: int) -> tuple[int, int]:
        """Fold node's subtree into its parent's [other]: (nodes removed, nodes created)."""
        parent = parents[node]
        other = child.get(parent << 32 | other_fid)
        created = 0
        if other is None:
            other = new_other[parent] = new_node(parent, other_fid)
            gone.append(0)
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
            for by_node in thread_counts:
                moved = by_node.pop(n, None)
                if moved:
                    count_threads(by_node, other, moved.items())   # bytes: recounted after compact
            if n < n_nodes:
                stack.extend(by_parent[start[n] : start[n + 1]])
                if n in new_other:
                    stack.append(new_other[n])
        del child[parent << 32 | node_frame[node]]
        return removed, created

    live, folded = n_nodes, 0
    for node in order:
        if live <= target:
            break
        if not gone[node] and node_frame[node] != other_fid:
            removed, created = fold(node)
            live -= removed - created
            folded += removed
    return gone, folded


class Compacted(NamedTuple):
    """A tree's lists after a fold, its survivors renumbered (tree.py's layout)."""

    frames: list[Frame]
    frame_ids: dict[Frame, int]
    parents: list[int]
    node_frame: list[int]
    child: dict[int, int]
    excl: dict[str, list[int]]
    leaf_of: dict[tuple[Frame, ...], int]
    threads: dict[str, dict[int, dict[int, int]]]


def compact(
    gone: bytearray,
    other_fid: int,
    frames: Sequence[Frame],
    parents: Sequence[int],
    node_frame: Sequence[int],
    excl: Mapping[str, Sequence[int]],
    leaf_of: Mapping[tuple[Frame, ...], int],
    threads: Mapping[str, Mapping[int, dict[int, int]]],
) -> Compacted:
    """Renumber the surviving nodes (keeping parent < child), drop unused frames, and keep
    the path cache entries of surviving contexts (re-walking every path after each fold
    cost more than the fold). Paths charged to an `[other]` are dropped: there may be room
    for them now.

    Written as chains of map/zip so the per-node work runs in C: a fold of 100k nodes
    spent most of its time here as a Python loop.
    """
    keep = list(compress(range(len(gone)), map(operator.not_, gone)))
    new_id = dict(zip(keep, range(len(keep))))
    new_parents = [-1]
    new_parents += map(new_id.__getitem__, map(parents.__getitem__, keep[1:]))
    used = sorted(set(map(node_frame.__getitem__, keep)))  # ROOT's 0 stays first
    new_fid = dict(zip(used, range(len(used))))
    new_node_frame = list(map(new_fid.__getitem__, map(node_frame.__getitem__, keep)))
    new_frames = list(map(frames.__getitem__, used))
    keys = map(operator.or_, map(operator.lshift, new_parents[1:], repeat(32)), new_node_frame[1:])
    return Compacted(
        frames=new_frames,
        frame_ids=dict(zip(new_frames, range(len(new_frames)))),
        parents=new_parents,
        node_frame=new_node_frame,
        child=dict(zip(keys, range(1, len(keep)))),
        excl={m: list(map(col.__getitem__, keep)) for m, col in excl.items()},
        leaf_of={path: new_id[node] for path, node in leaf_of.items()
                 if node in new_id and node_frame[node] != other_fid},
        # folded nodes handed their thread counts to an [other]: every node left is kept
        threads={m: {new_id[n]: t for n, t in by_node.items()} for m, by_node in threads.items()},
    )
