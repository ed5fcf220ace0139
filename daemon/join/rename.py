"""Launches counted before their kernel had a name, moved onto the named kernel in snapshots.

Pure (no privilege, no I/O); runs where the `Joiner` takes a snapshot (its aggregation thread).

Why (issue 29): a driver launch names its kernel by a CUfunction handle, and BPF reads a handle's
name only from the module-load event, so in a process attached after its modules were loaded each
kernel is first counted on `kernel:unresolved:0x<handle>`. The join learns the name from that
kernel's first joined GPU record (`Joiner._handle_names`); with the launch-order join records wait
SETTLE_NS (3 s) before they join. The launches before that stayed on the unresolved node, beside the
named kernel that got their GPU time: ~10% of all launches in the H200 recordings of run 31
(tests/data/gpu_run31: 73,480 of 732,351 in decode, 64,198 of 642,235 in eager training).

What `name_launches` does to a snapshot: every `kernel:unresolved:0xH` node whose handle has a
learnt name becomes that kernel's frame and is merged with the sibling of that name (metrics and
thread counts summed, children merged the same way, recursively). Handles never named stay as
they are; one note says how many launches carry no kernel name. meta["unresolved_kernels"] holds
the handles renamed ({handle: name}) and that count, so a snapshot taken before a name was learnt
can be renamed alike before it is diffed against this one (`name_launches(old, renamed)`).

Why in the snapshot and not in the live tree: the live tree keeps per-second buckets; moving a
count there means editing every bucket that holds it (the tree's internals) or adding signed
corrections to the open bucket, which a window view would show as negative launches. Here the hot
path (a launch, a kernel record) does not change at all.

Cost: a scan of the snapshot's distinct frames (nothing unresolved: 24-38 ms for 96,000 nodes on the
loaded 2-vCPU VM, against 180-410 ms for the snapshot itself); with some to rename, the snapshot
is built a second time through its public constructor (node ids shift where nodes merge): 16-19 ms
for the 3,100-3,300-node run-31 profiles, 0.3-0.5 s for 96,000 nodes (docs/benchmarks/join.md).
It runs where the snapshot is taken, on the aggregation thread; launches and kernel records cost
what they did.
"""

from __future__ import annotations

from collections.abc import Mapping
from itertools import accumulate, compress, repeat

from stacklens.cct import Frame, Snapshot
from stacklens.cct.tree import MAX_THREADS

UNRESOLVED = "unresolved:"
META_KEY = "unresolved_kernels"
NOTE = ("{n} kernel launches carry no kernel name (kernel:unresolved:0x…, the driver's function handle): "
        "their module was loaded before stacklens attached and no GPU record has named the kernel")
_NOTE_TAIL = NOTE.partition("}")[2]


def name_launches(snap: Snapshot, names: Mapping[str, str]) -> Snapshot:
    """`snap` with its unresolved kernels named from `names` ({"unresolved:0x…": kernel name}) and
    merged into their named siblings; the launches left unnamed said once in meta["notes"]. The
    same snapshot object when nothing is renamed (its meta, the snapshot's own copy, updated)."""
    n = snap.node_count
    handles = {f for f in set(map(snap.frame_of, range(n))) if f.kind == "kernel" and f.name.startswith(UNRESOLVED)}
    if not handles:
        return snap
    frames = list(map(snap.frame_of, range(n)))
    launches = snap.exclusive_column("launch_count") if "launch_count" in snap.metrics else None
    renamed: dict[str, str] = {}
    moved: list[int] = []
    unnamed = 0
    for i in compress(range(n), map(handles.__contains__, frames)):
        handle = frames[i].name
        name = names.get(handle)
        if name and not name.startswith(UNRESOLVED):
            frames[i] = Frame.kernel(name)
            renamed[handle] = name
            moved.append(i)
        elif launches is not None:
            unnamed += launches[i]
    meta = dict(snap.meta)
    notes = [x for x in meta.get("notes", ()) if _NOTE_TAIL not in x]   # once, also on a second pass
    if unnamed or "notes" in meta:
        meta["notes"] = [*notes, NOTE.format(n=unnamed)] if unnamed else notes
    meta[META_KEY] = {"renamed": renamed, "unnamed_launches": unnamed}
    if not renamed:
        snap.meta.clear()          # the snapshot's own deep copy: no second build for a note
        snap.meta.update(meta)
        return snap
    merge = _Merge(snap, frames)
    for p in sorted({snap.parent(i) for i in moved}):
        merge.children(p)          # siblings of one frame merged, recursively
    return merge.snapshot(meta)


class _Merge:
    """Nodes of `snap` given new frames (`frames`), siblings of one frame merged: the node with the
    larger id goes into the one with the smaller (its children re-attached there, merged the same
    way), so every parent keeps a smaller id than its children, as a Snapshot needs."""

    def __init__(self, snap: Snapshot, frames: list[Frame]) -> None:
        self.snap, self.frames = snap, frames
        self.parents = list(map(snap.parent, range(snap.node_count)))
        self.into: dict[int, int] = {}                 # merged node -> the node it went into
        self._kids: dict[int, dict[Frame, int]] = {}   # node -> {frame: child}, for nodes touched

    def children(self, x: int) -> dict[Frame, int]:
        """x's children by frame, built on first use (every original child attached once)."""
        m = self._kids.get(x)
        if m is None:
            m = self._kids[x] = {}
            for c in self.snap.children(x):
                self._attach(x, c)
        return m

    def _attach(self, a: int, c: int) -> None:
        m = self.children(a)
        f = self.frames[c]
        d = m.get(f)
        if d is None or d == c:
            m[f] = c
            self.parents[c] = a
            return
        keep, gone = (d, c) if d < c else (c, d)
        m[f] = keep
        self.parents[keep] = a
        self.into[gone] = keep
        for g in list(self.children(gone).values()):
            self._attach(keep, g)

    def snapshot(self, meta: dict) -> Snapshot:
        snap, n, into = self.snap, self.snap.node_count, self.into
        keep = [1] * n
        for gone in into:
            keep[gone] = 0
        rank = list(accumulate(keep, initial=-1))[1:]    # the new id of kept node i
        parents = [-1]
        parents += map(rank.__getitem__, compress(self.parents[1:], keep[1:]))
        target = {}
        for gone, to in into.items():              # merged node -> its kept node's new id
            while to in into:
                to = into[to]
            target[gone] = rank[to]
        excl = {}
        for m in snap.metrics:
            old = snap.exclusive_column(m)
            col = excl[m] = list(compress(old, keep))
            for gone, to in target.items():
                col[to] += old[gone]
        threads: dict[str, dict[int, dict[int, int]]] = {}
        for m in snap.threaded:
            by_node = threads[m] = {}
            for node, counts in enumerate(map(snap.threads, range(n), repeat(m))):
                if counts:
                    new = target.get(node)
                    if new is None:
                        by_node[rank[node]] = dict(counts)
                    else:
                        to = by_node.setdefault(new, {})
                        for tid, c in counts:
                            to[tid] = to.get(tid, 0) + c
            for node in set(target.values()):      # the cap of CCT.add_sample: the rest is "[other threads]"
                to = by_node.get(node)
                if to is not None and len(to) > MAX_THREADS:
                    by_node[node] = dict(sorted(to.items(), key=_by_count)[:MAX_THREADS])
        return Snapshot(snap.metrics, list(compress(self.frames, keep)), parents, excl,
                        unavailable=snap.unavailable, folded_nodes=snap.folded_nodes, meta=meta, threads=threads)


def _by_count(item: tuple[int, int]) -> tuple[int, int]:
    return -item[1], item[0]
