"""Folded stacks (`frame;frame;... VALUE` lines), what flame graph tools read.

Pure, no privilege, no I/O. Frames are named as py-spy names them in its folded output (`record
--format raw`), by the rule pprof and speedscope name them by too (render/stacks.py `frame_name`):
`function (file:line)` for Python (`Block.forward (model.py:17)`, the file short and the same on
every machine), `symbol (library)` for native code, the name of an operator, kernel or API call,
the label of every other kind (`backward:AddmmBackward0`, `[other]`).
"""

from __future__ import annotations

import re

from stacklens.cct.frames import ROOT, Frame
from stacklens.cct.snapshot import Snapshot
from stacklens.render.stacks import check_measured, frame_name

# ';' separates frames and a newline ends the record: written as their URL escapes
_ESCAPES = str.maketrans({";": "%3B", "\n": "%0A", "\r": "%0D"})
# flamegraph.pl reads a line's last blank-separated number as its value, and a second one before
# it as a differential profile's first value: no frame may end in one (`[other] 2`)
_ENDS_IN_NUMBER = re.compile(r"\s([0-9]+(?:\.[0-9]*)?)$")


def folded_frame(frame: Frame) -> str:
    """A frame as folded stacks name it: `frame_name(frame).text()`, with `;`, newlines and the
    blank before a number that ends the text written as their URL escapes (%3B, %0A, %20)."""
    text = frame_name(frame).text()
    if ";" in text or "\n" in text or "\r" in text:
        text = text.translate(_ESCAPES)
    # "0." is a number to flamegraph.pl too (`\d+(\.\d*)?`): a text ending in a digit or a dot is checked
    return _ENDS_IN_NUMBER.sub(r"%20\1", text) if text[-1:].isdigit() or text.endswith(".") else text


def to_folded(snap: Snapshot, metric: str, inclusive: bool = False) -> str:
    """Folded stacks, one `frame;frame;... VALUE` line per node with a non-zero value, outermost
    frame first, sorted.

    Exclusive values (the default) are what flame graph tools expect: they add the lines up
    themselves. `inclusive=True` writes each node's inclusive value instead, for grepping.
    """
    check_measured(snap, metric)
    value_of = snap.inclusive if inclusive else snap.exclusive
    names: dict[Frame, str] = {}
    stacks: list[str] = [folded_frame(ROOT)]
    lines = []
    for node in range(snap.node_count):
        if node:
            frame = snap.frame_of(node)
            own = names.get(frame)
            if own is None:
                own = names[frame] = folded_frame(frame)
            parent = snap.parent(node)
            stacks.append(f"{stacks[parent]};{own}" if parent else own)
        value = value_of(node, metric)
        if value and (node or not inclusive):
            lines.append(f"{stacks[node]} {value}")
    lines.sort()
    return "".join(line + "\n" for line in lines)
