"""Textual widgets of the TUI: the CCT tree (Line API, renders only visible rows) and the icicle.

No privilege. The widgets hold rows computed by `tui.model`; expansion state lives in the
screen, which the widgets tell through messages.
"""

from __future__ import annotations

from typing import Any

from rich.style import Style
from rich.text import Text
from textual import events
from textual.binding import Binding
from textual.geometry import Region, Size
from textual.message import Message
from textual.scroll_view import ScrollView
from textual.strip import Strip
from textual.widget import Widget

from stacklens.tui.model import (
    KIND_STYLE,
    SEP,
    Block,
    Row,
    Unit,
    bar,
    fit_chain,
    fmt_share,
    frame_text,
    icicle,
    kind_tag,
)

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


STRIP_CACHE = 512  # rendered lines kept per view (a few screens)


class _LineCache:
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


class CCTView(ScrollView, can_focus=True):
    """The calling context tree as lines; only the lines in view are rendered, and a line is
    rendered again only when what it shows changed (see `_LineCache`)."""

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
    COMPONENT_CLASSES = {"cctview--cursor"}

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
        self.cursor = 0
        self.unit = Unit("")
        self.total = 0
        self.signed = False
        self._lines = _LineCache()
        self._styles: tuple = ()  # (base, cursor) rich styles, looked up once per frame

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
        self._scroll_cursor_visible()
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

    # ---- rendering -------------------------------------------------------------------------
    def render_lines(self, crop: Region) -> list[Strip]:
        # `rich_style` walks every ancestor's styles (~0.25 ms): once per frame, not per line
        self._styles = (self.rich_style, self.get_component_rich_style("cctview--cursor"))
        return super().render_lines(crop)

    def render_line(self, y: int) -> Strip:
        width = self.size.width
        idx = int(self.scroll_offset.y) + y
        base, cursor_style = self._styles or (self.rich_style, self.get_component_rich_style("cctview--cursor"))
        if idx >= len(self.rows):
            return Strip.blank(width, base)
        row = self.rows[idx]
        is_cursor = idx == self.cursor
        context = (self.unit, self.total, self.signed, width, base, cursor_style)
        strip = self._lines.get(context, (row, is_cursor))
        if strip is not None:
            return strip
        text = row_text(row, self.unit, self.total, width, signed=self.signed)
        if is_cursor:
            text.stylize(cursor_style)
        segments = list(text.render(self.app.console))
        strip = Strip(segments).adjust_cell_length(width, base)
        if base:
            strip = strip.apply_style(base)
        self._lines.put((row, is_cursor), strip)
        return strip

    def on_resize(self, event: events.Resize) -> None:
        self.virtual_size = Size(event.size.width, len(self.rows))
        self._scroll_cursor_visible()

    # ---- moving ----------------------------------------------------------------------------
    def _scroll_cursor_visible(self) -> None:
        height = max(1, self.size.height)
        top = int(self.scroll_offset.y)
        if self.cursor < top:
            self.scroll_to(y=self.cursor, animate=False, immediate=True)
        elif self.cursor >= top + height:
            self.scroll_to(y=self.cursor - height + 1, animate=False, immediate=True)

    def move_to(self, index: int) -> None:
        if not self.rows:
            return
        old = self.cursor
        self.cursor = max(0, min(index, len(self.rows) - 1))
        top = self.scroll_offset.y
        self._scroll_cursor_visible()
        if self.scroll_offset.y == top:
            # only the two lines whose cursor highlight changed
            self.refresh_line(old)
            self.refresh_line(self.cursor)
        else:
            self.refresh()
        self.post_message(self.Moved(self.current))

    def action_cursor(self, step: int) -> None:
        self.move_to(self.cursor + step)

    def action_page(self, step: int) -> None:
        self.move_to(self.cursor + step * max(1, self.size.height - 1))

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
        self._lines = _LineCache()
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
