"""View models of the tree and flame views: rows of the expanded tree, icicle blocks, the keys
that expand it (hot path, a node's ancestors), search, and what of a collapsed chain fits a line.

No privilege, no I/O, no Textual. Cost is bounded by what is expanded or drawn, never by the size
of the tree, except `search_nodes` (one O(nodes) scan).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Callable, Sequence

from stacklens.cct import Frame
from stacklens.cct.labels import frame_text
from stacklens.tui.formatting import Snap, kind_tag

Key = tuple  # a node's path of frames from the root: stable across snapshots, unlike node ids
MAX_CHILDREN = 200  # per expanded node; the rest are summed into one "… N more" row


# ---- the tree ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Row:
    """One line of the tree view: a node, or a chain of single-child nodes shown as one line."""

    node: int  # the last node of the chain: the one whose children an expansion shows
    chain: tuple[int, ...]  # every node this row stands for, outermost first
    frames: tuple[Frame, ...]
    key: Key  # path of `node` from the root
    depth: int
    incl: int  # inclusive value of the chain (= of its first node)
    excl: int  # exclusive values summed over the chain
    has_children: bool
    expanded: bool
    more: int = 0  # > 0: a "… N more" row summarising N hidden siblings (node = their parent)

    @property
    def label(self) -> str:
        if self.more:
            return f"… {self.more} more"
        return " › ".join(frame_text(f) for f in self.frames)


def _value_columns(snap: Snap, metric: str) -> tuple[Callable[[int], int], Callable[[int], int]]:
    return (lambda n: snap.inclusive(n, metric)), (lambda n: snap.exclusive(n, metric))


def _visible_children(snap: Snap, node: int, incl: Callable[[int], int]) -> list[int]:
    return [c for c in snap.children(node) if incl(c)]


def tree_rows(
    snap: Snap,
    metric: str,
    expanded: set[Key] | frozenset[Key],
    *,
    sort: str = "inclusive",
    collapse_chains: bool = True,
    max_children: int = MAX_CHILDREN,
) -> list[Row]:
    """Rows of the expanded part of the tree, depth first, each level sorted by `sort`.

    Children with a zero value of `metric` are hidden. A node with exactly one visible child is
    merged with it into one row (so `train.py:step → aten::linear → aten::addmm` is one line),
    unless `collapse_chains` is off. Diff snapshots are sorted by absolute value.
    """
    if metric not in snap.metrics:
        return []
    incl, excl = _value_columns(snap, metric)
    rows: list[Row] = []

    def sort_children(kids: list[int]) -> list[int]:
        if sort == "name":
            return sorted(kids, key=lambda c: frame_text(snap.frame_of(c)).lower())
        value = excl if sort == "exclusive" else incl
        return sorted(kids, key=lambda c: (-abs(value(c)), c))

    def emit(parent: int, parent_key: Key, depth: int) -> None:
        kids = sort_children(_visible_children(snap, parent, incl))
        shown = kids[:max_children]
        for child in shown:
            chain = [child]
            frames = [snap.frame_of(child)]
            total_excl = excl(child)
            grandkids = _visible_children(snap, child, incl)
            while collapse_chains and len(grandkids) == 1:
                nxt = grandkids[0]
                chain.append(nxt)
                frames.append(snap.frame_of(nxt))
                total_excl += excl(nxt)
                grandkids = _visible_children(snap, nxt, incl)
            key = parent_key + tuple(frames)
            is_open = bool(grandkids) and key in expanded
            rows.append(
                Row(
                    node=chain[-1],
                    chain=tuple(chain),
                    frames=tuple(frames),
                    key=key,
                    depth=depth,
                    incl=incl(child),
                    excl=total_excl,
                    has_children=bool(grandkids),
                    expanded=is_open,
                )
            )
            if is_open:
                emit(chain[-1], key, depth + 1)
        if len(kids) > len(shown):
            hidden = kids[len(shown) :]
            rows.append(
                Row(
                    node=parent,
                    chain=(),
                    frames=(),
                    key=parent_key + (Frame.other("more"),),
                    depth=depth,
                    incl=sum(incl(c) for c in hidden),
                    excl=0,
                    has_children=False,
                    expanded=False,
                    more=len(hidden),
                )
            )

    emit(snap.root, (), 0)
    return rows


def hot_path_keys(snap: Snap, metric: str, start: int | None = None, *, max_depth: int = 64) -> set[Key]:
    """Keys that expand the heaviest child at each level from `start` (default: the root) down.

    Every prefix of the hot path is returned, so the expansion works whether or not single-child
    chains are collapsed.
    """
    if metric not in snap.metrics:
        return set()
    node = snap.root if start is None else start
    path = list(snap.path(node)) if node != snap.root else []
    keys: set[Key] = set()
    for _ in range(max_depth):
        kids = [c for c in snap.children(node) if snap.inclusive(c, metric)]
        if not kids:
            break
        node = max(kids, key=lambda c: (abs(snap.inclusive(c, metric)), -c))
        path.append(snap.frame_of(node))
        keys.add(tuple(path))
    return keys


def ancestor_keys(snap: Snap, node: int) -> set[Key]:
    """Every proper prefix of `node`'s path: expanding these makes `node` visible."""
    path = snap.path(node)
    return {path[:i] for i in range(1, len(path))}


def row_index_of(rows: Sequence[Row], node: int) -> int | None:
    for i, row in enumerate(rows):
        if node in row.chain:
            return i
    return None


def row_index_of_key(rows: Sequence[Row], key: Key) -> int | None:
    for i, row in enumerate(rows):
        if row.key == key:
            return i
    # the row may now be part of a longer or shorter chain: a row covering the key, else the
    # deepest row above it
    best, best_len = None, 0
    for i, row in enumerate(rows):
        if not row.frames:
            continue
        start = len(row.key) - len(row.frames)
        if len(row.key) >= len(key) > start and row.key[: len(key)] == key:
            return i
        if len(row.key) < len(key) and len(row.key) > best_len and key[: len(row.key)] == row.key:
            best, best_len = i, len(row.key)
    return best


def search_nodes(snap: Snap, query: str, metric: str, *, limit: int = 1000) -> list[int]:
    """Nodes whose label contains `query` (case-insensitive), heaviest by `metric` first."""
    q = query.strip().lower()
    if not q:
        return []
    labels: dict[Frame, bool] = {}
    hits = []
    use_metric = metric in snap.metrics
    for n in range(1, snap.node_count):
        f = snap.frame_of(n)
        ok = labels.get(f)
        if ok is None:
            ok = q in f.label().lower() or q in frame_text(f).lower()
            labels[f] = ok
        if ok:
            hits.append(n)
    if use_metric:
        return heapq.nsmallest(limit, hits, key=lambda n: (-abs(snap.inclusive(n, metric)), n))
    return hits[:limit]


# ---- icicle (flame graph, top down) --------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Block:
    start: int
    width: int
    node: int
    frame: Frame
    value: int


def icicle(snap: Snap, metric: str, root: int, width: int, max_depth: int) -> list[list[Block]]:
    """Levels of an icicle graph of `root`'s subtree: level 0 is `root` over the full width.

    Children are laid out left to right, heaviest first, each as wide as its share of the
    parent's (absolute) inclusive value; blocks under one cell are dropped.
    """
    if metric not in snap.metrics or width <= 0:
        return []
    total = abs(snap.inclusive(root, metric))
    if not total:
        return []
    levels: list[list[Block]] = [[Block(0, width, root, snap.frame_of(root), snap.inclusive(root, metric))]]
    scale = width / total
    for _ in range(max_depth - 1):
        nxt: list[Block] = []
        for parent in levels[-1]:
            x = float(parent.start)
            kids = sorted(
                (c for c in snap.children(parent.node) if snap.inclusive(c, metric)),
                key=lambda c: -abs(snap.inclusive(c, metric)),
            )
            for c in kids:
                v = snap.inclusive(c, metric)
                w = abs(v) * scale
                start, end = round(x), round(x + w)
                x += w
                if end - start >= 1:
                    nxt.append(Block(start, end - start, c, snap.frame_of(c), v))
        if not nxt:
            break
        levels.append(nxt)
    return levels


# ---- a collapsed chain in one line --------------------------------------------------------

# Dropped first when a chain does not fit: plumbing (native, API) before the user's own code.
_DROP_ORDER = {"native": 0, "other": 1, "instruction": 2, "gpu_api": 3, "kernel": 4, "python": 5, "module": 5,
               "op": 6, "backward": 7}
SEP = " › "


def chain_item_text(frame: Frame, tags: bool = True) -> str:
    tag = kind_tag(frame) if tags else ""
    return f"{tag} {frame_text(frame)}" if tag else frame_text(frame)


def fit_chain(frames: Sequence[Frame], width: int, *, tags: bool = True) -> list[Frame | None]:
    """The frames of a collapsed chain that fit in `width` cells; None marks an elided run.

    Always kept: the first and last frames, the innermost Python or module frame and the
    operator it called (the "which line, which op" answer). Dropped first: native and API frames, then
    kernels, then outer Python frames, then inner operators. What still does not fit is left
    for the caller to truncate.
    """
    frames = list(frames)

    def length(seq: list[Frame | None]) -> int:
        return sum(len(chain_item_text(f, tags)) if f is not None else 1 for f in seq) + len(SEP) * (len(seq) - 1)

    if length(frames) <= width or len(frames) <= 2:
        return frames
    must = {0, len(frames) - 1}
    py = [i for i, f in enumerate(frames) if f.kind in ("python", "module")]
    if py:
        must.add(py[-1])
        op = next((i for i in range(py[-1] + 1, len(frames)) if frames[i].kind == "op"), None)
        if op is not None:
            must.add(op)
    order = sorted(
        (i for i in range(len(frames)) if i not in must),
        # outer Python frames go before inner ones; inner operators before outer ones
        key=lambda i: (_DROP_ORDER.get(frames[i].kind, 0), i if frames[i].kind in ("python", "module") else -i),
    )
    keep = set(range(len(frames)))
    out: list[Frame | None] = frames
    for drop in order:
        keep.discard(drop)
        out = []
        for i, f in enumerate(frames):
            if i in keep:
                out.append(f)
            elif not out or out[-1] is not None:
                out.append(None)
        if length(out) <= width:
            break
    return out
