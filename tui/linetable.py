"""The hotspots table widget: a cursor over pre-rendered lines, only the lines in view rendered
(the drawing the CCT tree shares: tui/cursorlines.py).

No privilege, no I/O.
"""

from __future__ import annotations

from typing import Any

from rich.style import Style
from rich.text import Text
from textual import events
from textual.binding import Binding
from textual.geometry import Size
from textual.message import Message
from textual.strip import Strip

from stacklens.tui.cursorlines import CursorLines


class LineTable(CursorLines, can_focus=True):
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
    CURSOR_CLASS = "linetable--cursor"
    COMPONENT_CLASSES = {CURSOR_CLASS}

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

    def set_lines(self, lines: list[Text]) -> None:
        self.lines = lines
        self.cursor = max(0, min(self.cursor, len(lines) - 1))
        self.virtual_size = Size(max((ln.cell_len for ln in lines), default=0), len(lines))
        self.refresh()

    def plain_lines(self) -> list[str]:
        return [ln.plain for ln in self.lines]

    def line_count(self) -> int:
        return len(self.lines)

    def line_strip(self, idx: int, width: int, base: Style, cursor_style: Style) -> Strip:
        text = self.lines[idx].copy()  # text_strip stylizes it in place
        text.no_wrap = True
        return self.text_strip(text, width, base, cursor_style if idx == self.cursor else None,
                               int(self.scroll_offset.x))

    def action_select(self) -> None:
        if self.lines:
            self.post_message(self.Selected(self, self.cursor))

    def on_click(self, event: events.Click) -> None:
        idx = int(self.scroll_offset.y) + event.y
        if 0 <= idx < len(self.lines):
            again = idx == self.cursor
            self.move_to(idx)
            if again or event.chain > 1:
                self.action_select()
