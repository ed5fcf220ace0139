"""What the stack renderers (folded, pprof, speedscope) share: every node's path of frames, the
check that a metric was measured, and the unit of a metric.

Pure, no privilege, no I/O. Metrics listed in `snapshot.unavailable` were not measured: the
one-metric renderers refuse them, because showing them as 0 would claim a measurement that never
happened.
"""

from __future__ import annotations

from stacklens.cct.frames import ROOT, Frame
from stacklens.cct.metrics import BYTES, COUNT, TIME, kind_of
from stacklens.cct.snapshot import Snapshot
from stacklens.errors import InputError

_UNIT = {TIME: "nanoseconds", BYTES: "bytes", COUNT: "count"}


def unit_of(metric: str) -> str:
    """pprof unit of a metric (cct/metrics.py): nanoseconds, bytes or count."""
    return _UNIT[kind_of(metric)]


def check_measured(snap: Snapshot, metric: str) -> None:
    """InputError unless `metric` is one of the snapshot's metrics and was measured."""
    if metric not in snap.metrics:
        raise InputError(f"unknown metric {metric!r}; this profile has {', '.join(snap.metrics)}")
    if metric in snap.unavailable:
        measured = [m for m in snap.metrics if m not in snap.unavailable]
        raise InputError(
            f"metric {metric!r} was not measured in this profile; choose one of {', '.join(measured)}"
        )


def node_paths(snap: Snapshot) -> list[tuple[Frame, ...]]:
    """Path of every node, built parent-first in one pass; the root's is (ROOT,) so that a
    value recorded on the root itself still appears in the exports."""
    paths: list[tuple[Frame, ...]] = [(ROOT,)]
    for node in range(1, snap.node_count):
        parent = snap.parent(node)
        paths.append((paths[parent] if parent else ()) + (snap.frame_of(node),))
    return paths
