"""The flame pane: an icicle graph of the CCT and a one-line detail of the selected block.

No privilege. Drawing costs the blocks wide enough to show (tui.model.icicle).
"""

from __future__ import annotations

from typing import Any, Callable

from textual import on
from textual.app import ComposeResult
from textual.widgets import Static, TabPane

from stacklens.tui import model
from stacklens.tui.panes.base import View, put
from stacklens.tui.widgets import IcicleView


class FlamePane(TabPane):
    def __init__(self, title: str, *, view: Callable[[], View], id: str) -> None:
        super().__init__(title, id=id)
        self._view = view

    def compose(self) -> ComposeResult:
        yield IcicleView(id="icicle")
        yield Static(id="flame-detail", classes="detail")

    def forget(self) -> None:
        """Drop the replaced snapshot (the screen frees it off the UI thread)."""
        self.query_one(IcicleView).snap = None

    def refresh_flame(self) -> None:
        v = self._view()
        icicle = self.query_one(IcicleView)
        icicle.set_data(v.snap, v.metric)
        self._detail(icicle.selected)

    def _detail(self, block: Any) -> None:
        v = self._view()
        detail = self.query_one("#flame-detail", Static)
        if block is None or v.snap is None:
            put(detail, v.empty or "")
            return
        total = v.snap.total(v.metric)
        put(
            detail,
            f"{block.frame.label()}  {v.unit.fmt(block.value, signed=v.diff)}"
            f"  {model.fmt_share(block.value if v.diff else abs(block.value), abs(total), signed=v.diff).strip()}"
            "  (enter: zoom, backspace: out)"
        )

    @on(IcicleView.Selected)
    def _selected(self, event: IcicleView.Selected) -> None:
        self._detail(event.block)
