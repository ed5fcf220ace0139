"""What the CCT tree (tui/cctview.py) and the hotspots table (tui/linetable.py) draw their lines
with: a ScrollView of lines under a cursor (Line API), only the lines in view drawn, each from Rich
text, the cursor's line highlighted in the widget's cursor component style; the cursor's moves
(line, page), kept in view.

No privilege, no I/O.
"""

from __future__ import annotations

from typing import Any

from rich.style import Style
from rich.text import Text
from textual.geometry import Region
from textual.scroll_view import ScrollView
from textual.strip import Strip


class CursorLines(ScrollView):
    """`line_count()` lines, the one at `cursor` highlighted in the `CURSOR_CLASS` component style.
    A subclass draws one line in `line_strip` (from Rich text with `text_strip`); lines below the
    last are blank."""

    CURSOR_CLASS = ""  # the component class of the cursor's style, one of the subclass's COMPONENT_CLASSES

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.cursor = 0
        self._styles: tuple = ()  # (base, cursor) rich styles, looked up once per frame

    def line_count(self) -> int:
        raise NotImplementedError

    def line_strip(self, idx: int, width: int, base: Style, cursor: Style) -> Strip:
        """Line `idx`, `width` cells wide: `base` is the widget's style, `cursor` the cursor's."""
        raise NotImplementedError

    def text_strip(self, text: Text, width: int, base: Style, cursor: Style | None, x: int = 0) -> Strip:
        """`text` from cell `x`, cut or padded (with `base`) to `width`; highlighted with `cursor`
        where given (`text` is stylized in place)."""
        if cursor is not None:
            text.stylize(cursor)
        return Strip(list(text.render(self.app.console))).crop(x, x + width).adjust_cell_length(width, base)

    def render_lines(self, crop: Region) -> list[Strip]:
        # `rich_style` walks every ancestor's styles (~0.25 ms): once per frame, not per line
        self._styles = self._line_styles()
        return super().render_lines(crop)

    def render_line(self, y: int) -> Strip:
        width = self.size.width
        idx = int(self.scroll_offset.y) + y
        base, cursor = self._styles or self._line_styles()
        if idx >= self.line_count():
            return Strip.blank(width, base)
        return self.line_strip(idx, width, base, cursor)

    def _line_styles(self) -> tuple[Style, Style]:
        return self.rich_style, self.get_component_rich_style(self.CURSOR_CLASS)

    # -- the cursor ------------------------------------------------------------------------
    def move_to(self, index: int) -> None:
        """The cursor to line `index` (clamped), scrolled into view; where the view did not
        scroll, only the two lines whose highlight changed are drawn again. No lines: nothing."""
        if not self.line_count():
            return
        old = self.cursor
        self.cursor = max(0, min(index, self.line_count() - 1))
        top = int(self.scroll_offset.y)
        self.scroll_cursor_visible()
        if int(self.scroll_offset.y) == top:
            self.refresh_line(old)
            self.refresh_line(self.cursor)
        else:
            self.refresh()

    def scroll_cursor_visible(self) -> None:
        height = max(1, self.size.height)
        top = int(self.scroll_offset.y)
        if self.cursor < top:
            self.scroll_to(y=self.cursor, animate=False, immediate=True)
        elif self.cursor >= top + height:
            self.scroll_to(y=self.cursor - height + 1, animate=False, immediate=True)

    def action_cursor(self, step: int) -> None:
        self.move_to(self.cursor + step)

    def action_page(self, step: int) -> None:
        self.move_to(self.cursor + step * max(1, self.size.height - 1))
