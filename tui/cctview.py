"""The CCT tree widget: the calling context tree as lines (Line API), only the visible rows rendered
(the drawing the hotspots table shares: tui/cursorlines.py).

No privilege. It holds rows computed by `tui.model` (tui/treemodel.py); expansion state lives in
the tree pane (tui/panes/tree.py), which the widget tells through messages.
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

from stacklens.cct.labels import frame_text
from stacklens.tui.cursorlines import CursorLines
from stacklens.tui.formatting import KIND_STYLE, Unit, bar, fmt_share, kind_tag
from stacklens.tui.linecache import LineCache
from stacklens.tui.treemodel import SEP, Row, fit_chain

BAR_WIDTH = 10
VALUE_WIDTH = 8


def layout(width: int) -> tuple[int, int, bool]:
    """(bar width, value width, kind tags) for a terminal this wide: narrow ones keep the labels."""
    if width >= 120:
        return BAR_WIDTH, VALUE_WIDTH, True
    return 5, VALUE_WIDTH, False


def row_text(row: Row, unit: Unit, total: int, width: int, *, signed: bool = False) -> Text:
    """One tree line: bar, inclusive, exclusive, share (signed in a diff), indented label
    (kind-coloured); values in `unit` (CPU samples as time where the sampling rate is known)."""
    bar_w, val_w, tags = layout(width)
    share_base = abs(total) or 1
    t = Text(no_wrap=True, overflow="ellipsis")
    colour = "red" if signed and row.incl > 0 else ("green" if signed and row.incl < 0 else "bright_blue")
    t.append(bar(abs(row.incl) / share_base, bar_w), style=colour)
    t.append(" ")
    t.append(unit.fmt(row.incl, signed=signed).rjust(val_w))
    t.append(" ")
    t.append(("" if row.more else unit.fmt(row.excl, signed=signed)).rjust(val_w), style="dim")
    t.append(" ")
    t.append(fmt_share(row.incl, share_base, signed=True) if signed else fmt_share(abs(row.incl), share_base))
    t.append(" " + "  " * row.depth)
    if row.more:
        t.append(row.label, style="dim italic")
    else:
        t.append("▼ " if row.expanded else ("▶ " if row.has_children else "  "), style="bold")
        for i, f in enumerate(fit_chain(row.frames, width - t.cell_len, tags=tags)):
            if i:
                t.append(SEP, style="dim")
            if f is None:
                t.append("…", style="dim")
                continue
            tag = kind_tag(f) if tags else ""
            if tag:
                t.append(tag + " ", style=f"dim {KIND_STYLE.get(f.kind, '')}")
            t.append(frame_text(f), style=KIND_STYLE.get(f.kind, ""))
    t.truncate(width, overflow="ellipsis")
    return t


def header_text(label: str, sort: str, width: int, *, signed: bool = False) -> Text:
    bar_w, val_w, _ = layout(width)
    t = Text(no_wrap=True, style="bold")
    t.append(" " * bar_w + " ")
    t.append("incl".rjust(val_w) + " ")
    t.append("excl".rjust(val_w) + " ")
    t.append("  share " if signed else " share ")
    t.append(f"context  ({label}, by {sort})", style="bold")
    return t


class CCTView(CursorLines, can_focus=True):
    """The calling context tree as lines; only the lines in view are rendered, and a line is
    rendered again only when what it shows changed (see `LineCache`)."""

    BINDINGS = [
        Binding("up,k", "cursor(-1)", "up", show=False),
        Binding("down,j", "cursor(1)", "down", show=False),
        Binding("pageup", "page(-1)", show=False),
        Binding("pagedown", "page(1)", show=False),
        Binding("home", "home", show=False),
        Binding("end", "end", show=False),
        Binding("enter", "toggle", "expand", show=False),
        Binding("right,l", "expand", show=False),
        Binding("left", "collapse", show=False),
        Binding("e", "expand_hot", "hot path", show=False),
    ]

    DEFAULT_CSS = """
    CCTView { background: $surface; }
    CCTView > .cctview--cursor { background: $accent 40%; }
    """
    CURSOR_CLASS = "cctview--cursor"
    COMPONENT_CLASSES = {CURSOR_CLASS}

    class Toggle(Message):
        """Expand (True), collapse (False) or flip (None) a row."""

        def __init__(self, row: Row, expand: bool | None) -> None:
            super().__init__()
            self.row = row
            self.expand = expand

    class ExpandHot(Message):
        def __init__(self, row: Row) -> None:
            super().__init__()
            self.row = row

    class Moved(Message):
        def __init__(self, row: Row | None) -> None:
            super().__init__()
            self.row = row

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.rows: list[Row] = []
        self.unit = Unit("")
        self.total = 0
        self.signed = False
        self._lines = LineCache()

    # ---- data ------------------------------------------------------------------------------
    def set_rows(self, rows: list[Row], unit: Unit, total: int, *, signed: bool = False, cursor: int | None = None) -> None:
        self.rows = rows
        self.unit = unit
        self.total = total
        self.signed = signed
        if cursor is not None:
            self.cursor = cursor
        self.cursor = max(0, min(self.cursor, len(rows) - 1))
        self._set_virtual_height(len(rows))
        self.scroll_cursor_visible()
        self.refresh()

    def _set_virtual_height(self, height: int) -> None:
        """Set the scrollable height without a layout pass when the scrollbar stays as it is.

        Assigning `virtual_size` asks the whole screen for a layout, which re-renders every
        widget: ~50 ms for each expand, collapse or metric switch that changes the row count.
        Only showing or hiding the scrollbar needs one; otherwise updating the scrollbar's
        dimensions is enough (what the layout pass would do for this widget).
        """
        new = Size(self.size.width, height)
        old = self.virtual_size
        if new == old:
            return
        visible = self.container_size.height
        if visible and old.width == new.width and (old.height > visible) == (height > visible):
            self.set_reactive(CCTView.virtual_size, new)
            self._scroll_update(new)
            if self.scroll_offset.y > self.max_scroll_y:
                self.scroll_to(y=self.max_scroll_y, animate=False, immediate=True)
        else:
            self.virtual_size = new

    @property
    def current(self) -> Row | None:
        return self.rows[self.cursor] if 0 <= self.cursor < len(self.rows) else None

    def visible_lines(self) -> list[str]:
        """The plain text of the rows now on screen (for tests and the tmux check)."""
        top = int(self.scroll_offset.y)
        width = max(self.size.width, 40)
        return [row_text(r, self.unit, self.total, width, signed=self.signed).plain for r in self.rows[top : top + max(self.size.height, 1)]]

    # ---- rendering (the frame's styles and blank lines: CursorLines) -------------------------
    def line_count(self) -> int:
        return len(self.rows)

    def line_strip(self, idx: int, width: int, base: Style, cursor_style: Style) -> Strip:
        row = self.rows[idx]
        is_cursor = idx == self.cursor
        context = (self.unit, self.total, self.signed, width, base, cursor_style)
        strip = self._lines.get(context, (row, is_cursor))
        if strip is not None:
            return strip
        # row_text is cut to `width`: text_strip's crop leaves it whole
        strip = self.text_strip(row_text(row, self.unit, self.total, width, signed=self.signed), width, base,
                                cursor_style if is_cursor else None)
        if base:
            strip = strip.apply_style(base)
        self._lines.put((row, is_cursor), strip)
        return strip

    def on_resize(self, event: events.Resize) -> None:
        self.virtual_size = Size(event.size.width, len(self.rows))
        self.scroll_cursor_visible()

    # ---- moving ----------------------------------------------------------------------------
    def move_to(self, index: int) -> None:
        if self.rows:
            super().move_to(index)
            self.post_message(self.Moved(self.current))

    def action_home(self) -> None:
        self.move_to(0)

    def action_end(self) -> None:
        self.move_to(len(self.rows) - 1)

    def action_toggle(self) -> None:
        if self.current is not None:
            self.post_message(self.Toggle(self.current, None))

    def action_expand(self) -> None:
        row = self.current
        if row is not None and row.has_children and not row.expanded:
            self.post_message(self.Toggle(row, True))

    def action_collapse(self) -> None:
        row = self.current
        if row is None:
            return
        if row.expanded:
            self.post_message(self.Toggle(row, False))
            return
        for i in range(self.cursor - 1, -1, -1):  # go to the parent row
            if self.rows[i].depth < row.depth:
                self.move_to(i)
                return

    def action_expand_hot(self) -> None:
        if self.current is not None:
            self.post_message(self.ExpandHot(self.current))

    def on_click(self, event: events.Click) -> None:
        idx = int(self.scroll_offset.y) + event.y
        if not 0 <= idx < len(self.rows):
            return
        if idx == self.cursor or event.chain > 1:
            self.move_to(idx)
            self.action_toggle()
        else:
            self.move_to(idx)
