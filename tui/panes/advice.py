"""The advice pane: the analyzer's findings for the profile, worst first, each with its fix.

No privilege here: the findings come from the snapshot source (the daemon over gRPC, or the
analyzer in-process), on a worker thread, at most every ADVICE_EVERY_S while the pane is open.
"""

from __future__ import annotations

import time
from functools import partial
from typing import Any

from rich.text import Text
from textual.app import ComposeResult
from textual.message import Message
from textual.widgets import OptionList, TabPane
from textual.widgets.option_list import Option

from stacklens.tui import model
from stacklens.tui.model import Advice
from stacklens.tui.source import SnapshotSource

ADVICE_EVERY_S = 5.0  # the advice pane re-asks this often while it is open


class AdviceFetched(Message):
    def __init__(self, advice: list[Advice] | str) -> None:
        super().__init__()
        self.advice = advice


class AdvicePane(TabPane):
    def __init__(self, title: str, *, source: SnapshotSource, id: str) -> None:
        super().__init__(title, id=id)
        self.source = source
        self._advice: list[Advice] | str = "press a to load advice"
        self._paths: list[tuple[str, ...]] = []
        self._loaded_at = -1e9

    def compose(self) -> ComposeResult:
        yield OptionList(id="advice-list")

    def due(self) -> bool:
        return time.monotonic() - self._loaded_at > ADVICE_EVERY_S

    def path_at(self, index: int) -> tuple[str, ...] | None:
        return self._paths[index] if 0 <= index < len(self._paths) else None

    def load(self, window_s: float | None, raw: Any) -> None:
        self._loaded_at = time.monotonic()
        if isinstance(self._advice, str):
            self._show("loading advice …")
        self.run_worker(partial(self._worker, window_s, raw), thread=True, group="advice", exclusive=True, exit_on_error=False)

    def _worker(self, window_s: float | None, snap: Any) -> None:
        try:
            advice = self.source.advice(window_s, snap)
        except Exception as e:  # noqa: BLE001
            advice = f"advice failed: {type(e).__name__}: {e}"
        self.post_message(AdviceFetched(advice))

    def on_advice_fetched(self, message: AdviceFetched) -> None:
        self._show(message.advice)

    def _show(self, advice: list[Advice] | str) -> None:
        self._advice = advice
        ol = self.query_one("#advice-list", OptionList)
        keep = ol.highlighted or 0
        ol.clear_options()
        self._paths = []
        if isinstance(advice, str):
            ol.add_option(Option(Text(advice, style="dim"), disabled=True))
            return
        if not advice:
            ol.add_option(Option(Text("no findings: the rules flag nothing in this profile", style="dim"), disabled=True))
            return
        colours = {"critical": "bold red", "high": "red", "warning": "yellow", "medium": "yellow"}
        for a in model.sort_advice(advice):
            lines = model.advice_lines(a)
            t = Text()
            t.append(lines[0], style=colours.get(a.severity.lower(), "bold"))
            for ln in lines[1:]:
                t.append("\n" + ln, style="green" if ln.lstrip().startswith("fix:") else "")
            ol.add_option(Option(t))
            self._paths.append(a.path)
        ol.highlighted = min(keep, len(advice) - 1)
