"""The source pane: the lines around the selected node's nearest Python frame, each with the
metric's value on that line (where it has one) and its share, the frame's own line highlighted.

Reads the target's source file (bounded, tui.model.source_excerpt), through /proc/PID/root first
so a container's files are found; no other privilege. The per-line values are one O(nodes) scan
(tui.model.line_values) each time the pane is drawn.
"""

from __future__ import annotations

from typing import Any

from rich.console import Group
from rich.syntax import Syntax
from rich.text import Text
from textual.app import ComposeResult
from textual.containers import VerticalScroll
from textual.widgets import Static, TabPane

from stacklens.introspect.procfs import ProcFS
from stacklens.tui import model
from stacklens.tui.panes.base import View

VALUE_W = 9
SHARE_W = 7
CONTEXT = 200  # lines shown above and below the frame's line (scrolled to it)


def source_lines(ex: model.Excerpt, frame: Any, values: dict[int, int], unit: model.Unit, total: int,
                 *, signed: bool = False) -> list[Text]:
    """The excerpt's lines as `value share  lineno │ code`, the frame's line highlighted."""
    code = Syntax("", "python", theme="ansi_dark").highlight("\n".join(ex.lines)).split("\n", allow_blank=True)
    out = []
    for i, src in enumerate(code[: len(ex.lines)]):
        no = ex.first_line + i
        v = values.get(no)
        t = Text(no_wrap=True)
        if v:
            share = model.fmt_share(v, abs(total), signed=True) if signed else model.fmt_share(abs(v), abs(total))
            t.append(unit.fmt(v, signed=signed).rjust(VALUE_W), style="bold")
            t.append(" " + share.rjust(SHARE_W))
        else:
            t.append(" " * (VALUE_W + 1 + SHARE_W))
        t.append(f" {no:>5} │ ", style="dim")
        t.append_text(src.copy())
        if no == frame.line:
            t.stylize("on #303060")
        out.append(t)
    return out


class SourcePane(TabPane):
    def compose(self) -> ComposeResult:
        yield Static(id="source-head")  # file, line and what the values are: stays when scrolling
        with VerticalScroll(id="source-scroll"):
            yield Static(id="source-view")

    def show(self, v: View, node: int | None, pid: int | None) -> None:
        view = self.query_one("#source-view", Static)
        head_w = self.query_one("#source-head", Static)
        head_w.display = False
        snap = v.snap
        if snap is None or node is None:
            view.update("select a row in the tree (t) first")
            return
        frame = model.nearest_python(snap, node)
        roots = [str(ProcFS().root_dir(pid)), ""] if pid else [""]   # the target's files first
        ex = model.source_excerpt(frame, context=CONTEXT, roots=roots)
        if ex.message:
            view.update(Text(ex.message, style="dim"))
            return
        unit = v.unit
        if v.metric in snap.unavailable:
            values: dict[int, int] = {}
            note = f"{unit.label}: unavailable (not measured); no per-line values"
        else:
            values = model.line_values(snap, v.metric, frame.file)
            last = ex.first_line + len(ex.lines) - 1
            outside = sum(1 for no in values if not ex.first_line <= no <= last)
            note = f"{unit.label} per line (inclusive)" + ("" if values else ": none in this file")
            if outside:
                note += f"; {outside} more line{'s' if outside > 1 else ''} with values beyond these"
        head = Text(f"{frame.name}  {ex.path}:{frame.line}", style="bold green")
        head.append(f"   {note}", style="dim")
        head_w.update(head)
        head_w.display = True
        lines = source_lines(ex, frame, values, unit, snap.total(v.metric), signed=v.diff)
        view.update(Group(*lines))
        self.call_after_refresh(self._scroll_to, frame.line - ex.first_line)

    def _scroll_to(self, offset: int) -> None:
        """Bring line `offset` of the excerpt on screen (after the layout: the height is known),
        a third of the way down, and only where it would be below the screen."""
        scroll = self.query_one("#source-scroll", VerticalScroll)
        height = scroll.size.height
        scroll.scroll_to(y=0 if offset < height - 3 else offset - height // 3, animate=False)
