"""Where backward work is shown: on the forward line that caused it (the default) or under the
call that ran it (`loss.backward()`, what py-spy shows). docs/backward.md, "Two views".

Pure, no privilege, no I/O; O(nodes) plus one path walk per `backward:` node.

The tree keeps backward work in the forward view only: `forward context → backward:NODE →
backward ops`. The join (daemon/join/backward.py) also records, per linked head (forward
context + `backward:NODE`), the Python path of the thread that evaluated it, and the snapshot
carries that table in `meta["backward_callers"]`:

    {"callers": [[label, …], …], "heads": {head_key(head labels): caller index}}

`caller_view` moves each head found there, with everything below it, under its caller's path:
`loss.backward() → … → _engine_run_backward → backward:NODE → backward ops`; heads of one node
class under one caller merge. A head evaluated from several call sites is recorded under the
call sites' common caller (their longest common path), never under one of them. A head with no
entry (a compiled backward's node, or evicted from the bounded table) stays where it is and is
counted. Unlinked nodes already sit under their evaluating thread's Python frames: nothing to do.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

from stacklens.cct.frames import Frame
from stacklens.cct.snapshot import Snapshot

FORWARD, CALLER = "forward", "caller"
BACKWARD_VIEWS = (FORWARD, CALLER)
CALLERS = "backward_callers"       # meta key: the join's table
VIEW = "backward_view"             # meta key: which view a snapshot is in (absent: forward)
NOTE = ("backward view: caller: backward work sits under the call that ran it (loss.backward()), "
        "not under the forward line that caused it; the default view (--view forward) puts it there")


def head_key(labels: Iterable[str]) -> str:
    """The table's key of a head (its path's frame labels, outermost first): 16 hex digits."""
    return hashlib.blake2b("\n".join(labels).encode(), digest_size=8).hexdigest()


def split_view(view: str) -> tuple[str, str]:
    """("auto"|"model"|"full", "forward"|"caller") of a `--view` value: the model-view part and
    the backward part, joined by "+" (or ","), either one optional ("caller", "model+caller", "full")."""
    shape, backward = "auto", FORWARD
    for part in filter(None, (p.strip() for p in view.replace(",", "+").split("+"))):
        if part in BACKWARD_VIEWS:
            backward = part
        elif part in ("auto", "model", "full"):
            shape = part
        else:
            raise ValueError(f"unknown view {part!r}: choose auto, model or full, and/or forward or caller "
                             "(joined by +, e.g. model+caller)")
    return shape, backward


def caller_view(snap: Snapshot) -> Snapshot:
    """`snap` with every linked backward head under its caller (module docstring);
    `meta["backward_view"]` says "caller", `backward_view_moved` how many heads moved and
    `backward_view_kept` how many `backward:` nodes stayed (no caller recorded)."""
    if snap.meta.get(VIEW) == CALLER:
        return snap
    table = snap.meta.get(CALLERS) or {}
    heads = table.get("heads") or {}
    callers = [tuple(Frame.from_label(label) for label in c) for c in table.get("callers") or ()]
    frames: list[Frame] = [snap.frame_of(0)]
    parents: list[int] = [-1]
    index: dict[tuple[int, Frame], int] = {}
    out_of = [0] * snap.node_count
    caller_node: dict[int, int] = {}
    left = bytearray(snap.node_count)   # 1: a node a head moved out from under (may end up empty)

    def place(parent: int, frame: Frame) -> int:
        out = index.get((parent, frame))
        if out is None:
            out = index[(parent, frame)] = len(frames)
            frames.append(frame)
            parents.append(parent)
        return out

    moved = kept = 0
    for node in range(1, snap.node_count):
        frame = snap.frame_of(node)
        parent_out = out_of[snap.parent(node)]
        if frame.kind == "backward":
            idx = heads.get(head_key(f.label() for f in snap.path(node)))
            if idx is None or not 0 <= idx < len(callers):
                kept += 1
            else:
                moved += 1
                p = snap.parent(node)
                while p > 0 and not left[p]:
                    left[p] = 1
                    p = snap.parent(p)
                parent_out = caller_node.get(idx)
                if parent_out is None:
                    parent_out = 0
                    for f in callers[idx]:
                        parent_out = place(parent_out, f)
                    caller_node[idx] = parent_out
        out_of[node] = place(parent_out, frame)
    if not moved:
        return _with_meta(snap, moved, kept)
    return _prune(snap, frames, parents, out_of, left, moved, kept)


def _prune(snap: Snapshot, frames: list[Frame], parents: list[int], out_of: list[int], left: bytearray,
           moved: int, kept: int) -> Snapshot:
    """The new snapshot, less the forward-context nodes a move left with no value below them."""
    n = len(frames)
    excl = {m: [0] * n for m in snap.metrics}
    for m in snap.metrics:
        col, src = excl[m], snap.exclusive_column(m)
        for node, value in enumerate(src):
            if value:
                col[out_of[node]] += value
    threads: dict[str, dict[int, dict[int, int]]] = {}
    for m in snap.threaded:
        by = threads[m] = {}
        for node in range(snap.node_count):
            for tid, count in snap.threads(node, m):
                d = by.setdefault(out_of[node], {})
                d[tid] = d.get(tid, 0) + count
    live = bytearray(n)
    live[0] = 1
    for out in range(n - 1, 0, -1):   # children after parents: one reverse pass
        if live[out] or any(col[out] for col in excl.values()):
            live[out] = 1
            live[parents[out]] = 1
    may_go = bytearray(n)
    for node in range(1, snap.node_count):
        if left[node]:
            may_go[out_of[node]] = 1
    keep = [o for o in range(n) if live[o] or not may_go[o]]
    if len(keep) < n:
        new = {o: i for i, o in enumerate(keep)}
        frames = [frames[o] for o in keep]
        parents = [-1] + [new[parents[o]] for o in keep[1:]]
        excl = {m: [col[o] for o in keep] for m, col in excl.items()}
        threads = {m: {new[o]: t for o, t in by.items() if o in new} for m, by in threads.items()}
    meta = dict(snap.meta)
    meta.update({VIEW: CALLER, "backward_view_moved": moved, "backward_view_kept": kept})
    meta["notes"] = list(meta.get("notes") or []) + [NOTE]
    return Snapshot(snap.metrics, frames, parents, excl, unavailable=snap.unavailable,
                    folded_nodes=snap.folded_nodes, meta=meta, threads=threads)


def _with_meta(snap: Snapshot, moved: int, kept: int) -> Snapshot:
    meta = dict(snap.meta)
    meta.update({VIEW: CALLER, "backward_view_moved": moved, "backward_view_kept": kept})
    meta["notes"] = list(meta.get("notes") or []) + [NOTE]
    n = snap.node_count
    return Snapshot(snap.metrics, [snap.frame_of(i) for i in range(n)], [snap.parent(i) for i in range(n)],
                    {m: snap.exclusive_column(m) for m in snap.metrics}, unavailable=snap.unavailable,
                    folded_nodes=snap.folded_nodes, meta=meta,
                    threads={m: {i: dict(snap.threads(i, m)) for i in range(n) if snap.threads(i, m)}
                             for m in snap.threaded})


def pick_backward_view(snap: Snapshot, view: str) -> Snapshot:
    """`snap` in backward view `view` ("forward": as it is, "caller": `caller_view`)."""
    if view not in BACKWARD_VIEWS:
        raise ValueError(f"unknown backward view {view!r}; choose one of {', '.join(BACKWARD_VIEWS)}")
    return caller_view(snap) if view == CALLER else snap
