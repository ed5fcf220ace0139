"""The hotspots table widget: a cursor over pre-rendered lines, only the lines in view rendered.

No privilege, no I/O.
"""

from __future__ import annotations

from typing import Any

from rich.text import Text
from textual import events
from textual.binding import Binding
from textual.geometry import Region, Size
from textual.message import Message
from textual.scroll_view import ScrollView
from textual.strip import Strip


class LineTable(ScrollView, can_focus=True):
    """A cursor over pre-rendered lines (the hotspots table); renders only the lines in view.

    Textual's DataTable re-renders every cell after each update (~60 ms for 100 rows here);
    this draws at most a screenful of ready-made Text lines.
    """

    BINDINGS = [
        Binding("up,k", "cursor(-1)", show=False),
        Binding("down,j", "cursor(1)", show=False),
        Binding("pageup", "page(-1)", show=False),
        Binding("pagedown", "page(1)", show=False),
        Binding("home", "cursor(-1000000)", show=False),
        Binding("end", "cursor(1000000)", show=False),
        Binding("enter", "select", "go to", show=False),
    ]
    DEFAULT_CSS = """
    LineTable { background: $surface; }
    LineTable > .linetable--cursor { background: $accent 40%; }
    """
    COMPONENT_CLASSES = {"linetable--cursor"}

    class Selected(Message):
        def __init__(self, table: LineTable, index: int) -> None:
            super().__init__()
            self.table = table
            self.index = index

        @property
        def control(self) -> LineTable:
            return self.table

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.lines: list[Text] = []
        self.cursor = 0
        self._styles: tuple = ()

    def set_lines(self, lines: list[Text]) -> None:
        self.lines = lines
        self.cursor = max(0, min(self.cursor, len(lines) - 1))
        self.virtual_size = Size(max((ln.cell_len for ln in lines), default=0), len(lines))
        self.refresh()

    def plain_lines(self) -> list[str]:
        return [ln.plain for ln in self.lines]

    def render_lines(self, crop: Region) -> list[Strip]:
        self._styles = (self.rich_style, self.get_component_rich_style("linetable--cursor"))
        return super().render_lines(crop)

    def render_line(self, y: int) -> Strip:
        width = self.size.width
        idx = int(self.scroll_offset.y) + y
        base, cursor_style = self._styles or (self.rich_style, self.get_component_rich_style("linetable--cursor"))
        if idx >= len(self.lines):
            return Strip.blank(width, base)
        text = self.lines[idx].copy()
        text.no_wrap = True
        if idx == self.cursor:
            text.stylize(cursor_style)
        strip = Strip(list(text.render(self.app.console))).crop(int(self.scroll_offset.x), int(self.scroll_offset.x) + width)
        return strip.adjust_cell_length(width, base)

    def action_cursor(self, step: int) -> None:
        if not self.lines:
            return
        old = self.cursor
        self.cursor = max(0, min(self.cursor + step, len(self.lines) - 1))
        height = max(1, self.size.height)
        top = int(self.scroll_offset.y)
        if self.cursor < top:
            self.scroll_to(y=self.cursor, animate=False, immediate=True)
        elif self.cursor >= top + height:
            self.scroll_to(y=self.cursor - height + 1, animate=False, immediate=True)
        if int(self.scroll_offset.y) == top:
            self.refresh_line(old)
            self.refresh_line(self.cursor)
        else:
            self.refresh()

    def action_page(self, step: int) -> None:
        self.action_cursor(step * max(1, self.size.height - 1))

    def action_select(self) -> None:
        if self.lines:
            self.post_message(self.Selected(self, self.cursor))

    def on_click(self, event: events.Click) -> None:
        idx = int(self.scroll_offset.y) + event.y
        if 0 <= idx < len(self.lines):
            again = idx == self.cursor
            self.action_cursor(idx - self.cursor)
            if again or event.chain > 1:
                self.action_select()
