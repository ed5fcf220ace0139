"""The flame graph widget: a top-down icicle of a subtree, one level a line (Line API).

No privilege. Blocks come from `tui.model.icicle` (tui/treemodel.py), recomputed only when the
snapshot, metric, zoom or size changes; moving the selection re-renders two lines.
"""

from __future__ import annotations

from typing import Any

from rich.style import Style
from rich.text import Text
from textual import events
from textual.binding import Binding
from textual.geometry import Region
from textual.message import Message
from textual.strip import Strip
from textual.widget import Widget

from stacklens.cct.labels import frame_text
from stacklens.tui.linecache import LineCache
from stacklens.tui.treemodel import Block, icicle


class IcicleView(Widget, can_focus=True):
    """Top-down flame graph of the subtree at `root`; enter zooms in, backspace zooms out."""

    BINDINGS = [
        Binding("up,k", "level(-1)", show=False),
        Binding("down,j", "level(1)", show=False),
        Binding("left", "sibling(-1)", show=False),
        Binding("right,l", "sibling(1)", show=False),
        Binding("enter", "zoom", "zoom", show=False),
        Binding("backspace,u", "unzoom", "zoom out", show=False),
    ]
    DEFAULT_CSS = """
    IcicleView { background: $surface; }
    """

    _BG = {
        "python": "#2e6b34",
        "op": "#1f5f7a",
        "native": "#555555",
        "gpu_api": "#7a6a1f",
        "kernel": "#6b2e6b",
        "instruction": "#2e3f6b",
        "backward": "#7a2e2e",
        "other": "#3a3a3a",
    }

    class Selected(Message):
        def __init__(self, block: Block | None) -> None:
            super().__init__()
            self.block = block

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.snap: Any = None
        self.metric = ""
        self.zoom: tuple = ()  # path of the zoomed node: survives snapshot updates
        self.level = 0
        self.index = 0
        self._levels: list[list[Block]] = []
        self._cache_key: tuple = ()
        self._lines = LineCache()
        self._generation = 0  # of `_levels`: keys the line cache
        self._shown: tuple = (-1, -1)  # (generation, level) of the last selection change

    def set_data(self, snap: Any, metric: str) -> None:
        self.snap = snap
        self.metric = metric
        self._shown = (-1, -1)
        self.refresh()

    def _root(self) -> int:
        if self.snap is None or not self.zoom:
            return 0
        node = self.snap.find([f.label() for f in self.zoom])
        return 0 if node is None else node

    def levels(self) -> list[list[Block]]:
        key = (id(self.snap), self.metric, self.zoom, self.size.width, self.size.height)
        if key != self._cache_key:
            self._cache_key = key
            self._generation += 1
            if self.snap is None:
                self._levels = []
            else:
                self._levels = icicle(self.snap, self.metric, self._root(), self.size.width, max(1, self.size.height - 1))
        return self._levels

    @property
    def selected(self) -> Block | None:
        levels = self.levels()
        if not levels:
            return None
        self.level = max(0, min(self.level, len(levels) - 1))
        row = levels[self.level]
        self.index = max(0, min(self.index, len(row) - 1))
        return row[self.index]

    def _level_text(self, li: int, level: list[Block], sel: Block | None, width: int) -> Text:
        out = Text(no_wrap=True)
        x = 0
        for b in level:
            if b.start > x:
                out.append(" " * (b.start - x))
            label = (" " + frame_text(b.frame)).ljust(b.width)[: b.width]
            style = Style(bgcolor=self._BG.get(b.frame.kind, "#3a3a3a"), color="white")
            if b is sel:
                style = Style(bgcolor="white", color="black", bold=True)
            out.append(label, style=style)
            x = b.start + b.width
        if x < width:
            out.append(" " * (width - x))
        return out

    def render(self) -> Text:
        levels = self.levels()
        width = self.size.width
        if not levels:
            return Text("nothing to draw for this metric", style="dim")
        sel = self.selected
        return Text("\n", no_wrap=True).join(self._level_text(li, level, sel, width) for li, level in enumerate(levels))

    def render_lines(self, crop: Region) -> list[Strip]:
        self._base = self.rich_style  # once per frame (it walks every ancestor's styles)
        return super().render_lines(crop)

    def render_line(self, y: int) -> Strip:
        """One level per line (Line API), cached: moving the selection re-renders two lines,
        not the whole graph (~20 ms at 160x50)."""
        levels = self.levels()
        if not levels:
            return super().render_line(y)
        width = self.size.width
        base = getattr(self, "_base", None) or self.rich_style
        if y >= len(levels):
            return Strip.blank(width, base)
        sel = self.selected
        picked = self.index if self.level == y else -1
        key = (y, picked)
        strip = self._lines.get((self._generation, width, base), key)
        if strip is None:
            text = self._level_text(y, levels[y], sel, width)
            strip = Strip(list(text.render(self.app.console))).adjust_cell_length(width, base)
            if base:
                strip = strip.apply_style(base)
            self._lines.put(key, strip)
        return strip

    def visible_lines(self) -> list[str]:
        return self.render().plain.split("\n")

    def action_level(self, step: int) -> None:
        sel = self.selected
        levels = self.levels()
        if sel is None:
            return
        new = max(0, min(self.level + step, len(levels) - 1))
        if new != self.level:
            # keep the block under (or nearest to) the middle of the current one
            mid = sel.start + sel.width // 2
            row = levels[new]
            self.index = min(range(len(row)), key=lambda i: 0 if row[i].start <= mid < row[i].start + row[i].width else 1 + min(abs(row[i].start - mid), abs(row[i].start + row[i].width - mid)))
            self.level = new
        self._changed()

    def action_sibling(self, step: int) -> None:
        self.index += step
        self._changed()

    def action_zoom(self) -> None:
        sel = self.selected
        if sel is not None and self.snap is not None and sel.node != 0:
            self.zoom = self.snap.path(sel.node)
            self.level = self.index = 0
            self._changed()

    def action_unzoom(self) -> None:
        if self.zoom:
            self.zoom = self.zoom[:-1]
            self.level = self.index = 0
            self._changed()

    def _changed(self) -> None:
        sel = self.selected  # clamps level and index (and recomputes the levels if needed)
        generation, old_level = self._shown
        if generation == self._generation:
            # same graph: only the levels whose highlight moved
            self.refresh(Region(0, old_level, self.size.width, 1), Region(0, self.level, self.size.width, 1))
        else:
            self.refresh()
        self._shown = (self._generation, self.level)
        self.post_message(self.Selected(sel))

    def on_click(self, event: events.Click) -> None:
        levels = self.levels()
        if not 0 <= event.y < len(levels):
            return
        for i, b in enumerate(levels[event.y]):
            if b.start <= event.x < b.start + b.width:
                self.level, self.index = event.y, i
                if event.chain > 1:
                    self.action_zoom()
                else:
                    self._changed()
                return
