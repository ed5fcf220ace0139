"""Rendered lines kept by what they show: the cache behind the tree's and the flame graph's lines.

No privilege, no I/O.
"""

from __future__ import annotations

from typing import Any

from textual.strip import Strip

STRIP_CACHE = 512  # rendered lines kept per view (a few screens)


class LineCache:
    """Rendered lines keyed by what they show; cleared when the keys' meaning changes.

    Rendering one line (Rich text → segments → Strip) costs ~0.5 ms: a full 50-line view is
    ~25 ms, so a cursor move or a page down re-renders only lines not seen before.
    """

    def __init__(self, size: int = STRIP_CACHE) -> None:
        self.size = size
        self.context: tuple = ()
        self.lines: dict[Any, Strip] = {}

    def get(self, context: tuple, key: Any) -> Strip | None:
        if context != self.context:
            self.context = context
            self.lines.clear()
            return None
        return self.lines.get(key)

    def put(self, key: Any, strip: Strip) -> None:
        if len(self.lines) >= self.size:
            self.lines.clear()
        self.lines[key] = strip
