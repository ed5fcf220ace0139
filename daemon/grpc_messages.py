"""The stacklens service's messages: bounds on what a request asks, responses built from the daemon's objects.

Pure but for protobuf: no privilege, no I/O, no daemon state. Checks raise InputError saying what
is allowed (gRPC INVALID_ARGUMENT through ``grpc_calls.rpc``); PIDs are checked by the caller with
``introspect.procfs.check_pid_range``. ``prune`` cuts a snapshot to a request's depth and top_k
with exact totals; ``finding_to_pb`` and ``attach_response`` turn an analyzer finding and an
attach's progress into their messages.
"""

from __future__ import annotations

import math

from stacklens.cct import CCT, Frame, Snapshot
from stacklens.daemon import stacklens_pb2 as pb
from stacklens.daemon.attachop import ATTACHING, AttachOp
from stacklens.errors import InputError

MAX_WINDOW_S = 60.0  # window + diff window must fit the 120 s horizon of the tree
MAX_ATTACH_WAIT_S = 30.0   # one Attach/WaitAttach call waits at most this long for progress


def check_window(w: float, name: str = "window_s") -> float | None:
    """A window in seconds, or None for 0 (cumulative)."""
    if math.isnan(w) or w < 0 or w > MAX_WINDOW_S:
        raise InputError(f"{name} must be within 0..{MAX_WINDOW_S:g} seconds (0 = cumulative)")
    return w or None


def check_wait(w: float) -> float:
    """How long an attach call may wait, cut to MAX_ATTACH_WAIT_S."""
    if math.isnan(w) or w < 0:
        raise InputError("wait_s must be >= 0 seconds (0: answer at the attach's end)")
    return min(w, MAX_ATTACH_WAIT_S)


def prune(snap: Snapshot, metric: str, depth: int, top_k: int) -> Snapshot:
    """`snap` limited to `depth` levels and the `top_k` children (by inclusive metric) per node.

    What is cut is charged to the nearest kept ancestor (to `[other]` at the top), so every
    inclusive value that is kept, and every total, stays exact.
    """
    if not depth and not top_k:
        return snap
    keep = {snap.root}
    stack = [(snap.root, 0)]
    while stack:
        node, d = stack.pop()
        if depth and d >= depth:
            continue
        kids = sorted(snap.children(node), key=lambda c: snap.inclusive(c, metric), reverse=True)
        for c in kids[: top_k or None]:
            keep.add(c)
            stack.append((c, d + 1))
    tree = CCT(metrics=snap.metrics, max_nodes=len(keep) + 2)
    other = (Frame.other("[other]"),)
    threaded = snap.threaded
    for n in range(snap.node_count):
        values = {m: snap.exclusive(n, m) for m in snap.metrics}
        if not any(values.values()):
            continue
        a = n
        while a not in keep:
            a = snap.parent(a)
        path = snap.path(a) or other
        for m in threaded:            # the breakdown by thread goes with the values
            for tid, count in snap.threads(n, m):
                tree.add_sample(path, m, tid, count)
                values[m] -= count
        tree.add_many(path, values)
    return tree.snapshot(meta=dict(snap.meta), unavailable=snap.unavailable)


def attach_response(op: AttachOp, joined: bool = False) -> pb.AttachResponse:
    """The attach's progress, or its notes once it ended well; its error (raised) if it failed."""
    phase, phase_s, elapsed_s = op.progress()
    if op.ended:
        return pb.AttachResponse(pid=op.pid, notes=op.result(), state="attached", attach_id=op.id,
                                 step=op.step, elapsed_s=elapsed_s, joined=joined)
    return pb.AttachResponse(pid=op.pid, state=ATTACHING, phase=phase, phase_s=phase_s, elapsed_s=elapsed_s,
                             attach_id=op.id, step=op.step, joined=joined)


def finding_to_pb(f) -> pb.Finding:
    return pb.Finding(
        rule=f.rule,
        severity=str(f.severity),
        path=list(f.path),
        title=f.title,
        fix=f.fix,
        estimated_saving_share=float(f.estimated_saving or 0.0),
        evidence=[pb.Evidence(metric=k, value=float(v), unit="") for k, v in f.evidence.items()],
    )


__all__ = ["MAX_ATTACH_WAIT_S", "MAX_WINDOW_S", "attach_response", "check_wait", "check_window", "finding_to_pb",
           "prune"]
