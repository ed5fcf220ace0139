"""Folded stacks (`label;label;... VALUE` lines), what flame graph tools read.

Pure, no privilege, no I/O.
"""

from __future__ import annotations

from stacklens.cct.frames import ROOT, Frame
from stacklens.cct.snapshot import Snapshot
from stacklens.render.stacks import check_measured


def _folded_label(frame: Frame) -> str:
    # ';' separates frames and a newline ends the record in the folded format.
    return frame.label().replace(";", "%3B").replace("\n", "%0A")


def to_folded(snap: Snapshot, metric: str, inclusive: bool = False) -> str:
    """Folded stacks, one `label;label;... VALUE` line per node with a non-zero value, sorted.

    Exclusive values (the default) are what flame graph tools expect: they add the lines up
    themselves. `inclusive=True` writes each node's inclusive value instead, for grepping.
    """
    check_measured(snap, metric)
    value_of = snap.inclusive if inclusive else snap.exclusive
    labels: list[str] = [_folded_label(ROOT)]
    lines = []
    for node in range(snap.node_count):
        if node:
            parent = snap.parent(node)
            own = _folded_label(snap.frame_of(node))
            labels.append(f"{labels[parent]};{own}" if parent else own)
        value = value_of(node, metric)
        if value and (node or not inclusive):
            lines.append(f"{labels[node]} {value}")
    lines.sort()
    return "".join(line + "\n" for line in lines)

