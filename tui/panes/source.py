"""The source pane: the lines around the selected node's nearest Python frame, highlighted.

Reads the target's source file (bounded, tui.model.source_excerpt), through /proc/PID/root first
so a container's files are found; no other privilege.
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


class SourcePane(TabPane):
    def compose(self) -> ComposeResult:
        with VerticalScroll(id="source-scroll"):
            yield Static(id="source-view")

    def show(self, snap: Any, node: int | None, pid: int | None) -> None:
        view = self.query_one("#source-view", Static)
        if snap is None or node is None:
            view.update("select a row in the tree (t) first")
            return
        frame = model.nearest_python(snap, node)
        roots = [str(ProcFS().root_dir(pid)), ""] if pid else [""]   # the target's files first
        ex = model.source_excerpt(frame, roots=roots)
        if ex.message:
            view.update(Text(ex.message, style="dim"))
            return
        syntax = Syntax(
            "\n".join(ex.lines),
            "python",
            line_numbers=True,
            start_line=ex.first_line,
            highlight_lines={frame.line},
            theme="ansi_dark",
            word_wrap=False,
        )
        head = Text(f"{frame.name}  {ex.path}:{frame.line}", style="bold green")
        view.update(Group(head, syntax))
