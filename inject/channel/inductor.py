"""The daemon's check of the agent's ``inductor`` messages (``inject/agent/inductor.py``).

Hostile input: every row is checked and its strings cut and escaped; nothing is executed or
opened. A message holds at most MAX_ROWS rows; text rows are kept as data for the pure mapping
(``daemon/join/compiled.py``).
"""

from __future__ import annotations

from stacklens.records.agent import InductorRecord
from stacklens.inject.channel.validate import MAX_FRAME_FILE, MAX_FRAME_NAME, ProtocolError
from stacklens.inject.channel.validate import check_int as _int, check_list as _list, check_row as _row
from stacklens.inject.channel.validate import check_str as _raw, clip_text

MAX_PARTS = 256
MAX_ROWS = 20000
MAX_TEXT = 4096
MAX_TRACE = 8192
MAX_LINE = 1 << 31


def parse_inductor(msg: dict) -> InductorRecord:
    parts = _int(msg.get("parts"), 1, MAX_PARTS)
    traces, regions, nodes, lines = [], [], [], []
    for r in _list(msg.get("r"), MAX_ROWS):
        if type(r) is not list or not r:
            raise ProtocolError("bad inductor row")
        tag = r[0]
        if tag == "T":
            # kept raw: the mapping parses it, its frames are cut and escaped there like any frame
            traces.append(_raw(_row(r, 2)[1], MAX_TRACE, "bad inductor trace"))
        elif tag == "M":
            _, line, idx = _row(r, 3)
            regions.append((_int(line, 1, MAX_LINE), _int(idx, 0, MAX_ROWS)))
        elif tag == "N":
            _, name, file, line, func = _row(r, 5)
            nodes.append((clip_text(name, MAX_FRAME_NAME), clip_text(file, MAX_FRAME_FILE), _int(line, 0, MAX_LINE),
                          clip_text(func, MAX_FRAME_NAME)))
        elif tag == "S":
            _, line, text = _row(r, 3)
            lines.append((_int(line, 1, MAX_LINE), _raw(text, MAX_TEXT, "bad inductor line")))
        else:
            raise ProtocolError("bad inductor row")
    return InductorRecord(clip_text(msg.get("path"), MAX_FRAME_FILE), _int(msg.get("part"), 0, parts - 1), parts,
                          tuple(traces), tuple(regions), tuple(nodes), tuple(lines))
