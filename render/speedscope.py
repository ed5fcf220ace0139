"""speedscope's file format (https://www.speedscope.app/file-format-schema.json).

Pure, no privilege, no I/O.
"""

from __future__ import annotations

from typing import Any

from stacklens import __version__
from stacklens.cct.frames import Frame
from stacklens.cct.snapshot import Snapshot
from stacklens.render.stacks import check_measured, node_paths, unit_of

_SPEEDSCOPE_UNIT = {"nanoseconds": "nanoseconds", "bytes": "bytes", "count": "none"}


def to_speedscope(snap: Snapshot, metric: str) -> dict[str, Any]:
    """A speedscope file (https://www.speedscope.app/file-format-schema.json) with one sampled
    profile: one sample per node with a non-zero exclusive value, weighted by that value."""
    check_measured(snap, metric)
    frame_index: dict[Frame, int] = {}
    frames: list[dict[str, Any]] = []
    samples: list[list[int]] = []
    weights: list[int] = []
    paths = node_paths(snap)
    for path in paths:
        frame = path[-1]
        if frame not in frame_index:
            frame_index[frame] = len(frames)
            entry: dict[str, Any] = {"name": frame.label()}
            if frame.file:
                entry["file"] = frame.file
            if frame.line:
                entry["line"] = frame.line
            frames.append(entry)
    for node in range(snap.node_count):
        value = snap.exclusive(node, metric)
        if value:
            samples.append([frame_index[f] for f in paths[node]])
            weights.append(value)
    name = str(snap.meta.get("name", "stacklens"))
    return {
        "$schema": "https://www.speedscope.app/file-format-schema.json",
        "shared": {"frames": frames},
        "profiles": [
            {
                "type": "sampled",
                "name": f"{name} {metric}",
                "unit": _SPEEDSCOPE_UNIT[unit_of(metric)],
                "startValue": 0,
                "endValue": sum(weights),
                "samples": samples,
                "weights": weights,
            }
        ],
        "name": name,
        "activeProfileIndex": 0,
        "exporter": f"stacklens {__version__}",
    }

