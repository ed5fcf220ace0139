"""The keys of the profile screen and what each does: views, metric, sort, window, diff, search, ….

No privilege, no I/O. `ProfileKeys` is the base of `ProfileScreen` (tui/profile.py): Textual finds
a key's action by name on the screen, so the actions live on the screen's class; this one holds
them, the screen holds the state they change and draws it. The help screen and the key line are
generated from `BINDINGS` (tui/help.py).
"""

from __future__ import annotations

from typing import Any

from textual import on
from textual.binding import Binding
from textual.screen import Screen
from textual.widgets import Input, OptionList, TabbedContent

from stacklens.tui import model
from stacklens.tui.help import HelpScreen
from stacklens.tui.widgets import CCTView, IcicleView, LineTable


SAVED_OFF = frozenset({"window", "diff", "pause", "refresh", "detach"})   # not for a saved profile


class ProfileKeys(Screen):
    """The profile screen's bindings and actions. What they change (the view state below) and
    how it is drawn (`refresh_views`, `_update_status`, `reveal`, …) belong to `ProfileScreen`."""

    BINDINGS = [
        Binding("t,1", "view('tree')", "tree"),
        Binding("f,2", "view('flame')", "flame"),
        Binding("h,3", "view('hotspots')", "hotspots"),
        Binding("a,4", "view('advice')", "advice"),
        Binding("o,5", "view('source')", "source"),
        Binding("m", "metric(1)", "metric"),
        Binding("M", "metric(-1)", "metric back", show=False),
        Binding("v", "model_view", "model/full"),
        Binding("s", "sort", "sort"),
        Binding("w", "window", "window"),
        Binding("d", "diff", "diff"),
        Binding("slash", "search", "search"),
        Binding("n", "next_match(1)", "next", show=False),
        Binding("N", "next_match(-1)", "previous", show=False),
        Binding("c", "chains", "chains", show=False),
        Binding("p", "pause", "pause"),
        Binding("r", "refresh", "refresh", show=False),
        Binding("x", "detach", "detach", show=False),
        Binding("escape", "back", "back", show=False),
        Binding("q", "app.quit", "quit"),
        Binding("question_mark", "help", "help", show=False),
    ]

    # the view state the keys change (set up and drawn by ProfileScreen)
    snap: Any
    metric: str
    sort: str
    view_mode: str
    window_index: int
    diff: bool
    paused: bool
    collapse_chains: bool
    note: str
    matches: list[int]
    match_index: int
    search_query: str

    # ---- views -------------------------------------------------------------------------------
    def action_view(self, view: str) -> None:
        tabs = self.query_one(TabbedContent)
        if tabs.active == view:
            self._on_view(view)
        else:
            tabs.active = view  # TabActivated then calls _on_view

    @on(TabbedContent.TabActivated)
    def _tab_activated(self, event: TabbedContent.TabActivated) -> None:
        self._on_view(event.pane.id or "tree")

    def _on_view(self, view: str) -> None:
        focus = {"tree": CCTView, "flame": IcicleView, "hotspots": LineTable, "advice": OptionList}.get(view)
        if focus is not None:
            self.query_one(focus).focus()
        if view == "flame":
            self._flame.refresh_flame()
        elif view == "hotspots":
            self._hot.refresh_hotspots()
        elif view == "source":
            self._refresh_source()
            self.query_one("#source-scroll").focus()
        elif view == "advice":
            self.load_advice()

    def action_help(self) -> None:
        self.app.push_screen(HelpScreen([
            ("anywhere", self.BINDINGS), ("tree", CCTView.BINDINGS), ("flame", IcicleView.BINDINGS),
            ("hotspots", LineTable.BINDINGS), ("help", HelpScreen.BINDINGS)]))

    def action_back(self) -> None:
        box = self.query_one("#search", Input)
        if box.display:
            box.display = False
            self.query_one(CCTView).focus()
            return
        if self.query_one(TabbedContent).active != "tree":
            self.action_view("tree")
            return
        if len(self.app.screen_stack) > 2:
            self.app.pop_screen()

    # ---- what is shown -----------------------------------------------------------------------
    def action_metric(self, step: int) -> None:
        self.metric = model.next_metric(self.snap, self.metric, step)
        self._tree.expand_hot_if_hidden(self.snap, self.metric)
        self.refresh_views()

    def action_model_view(self) -> None:
        """Model view <-> full view: the next fetch comes in the other one; frames differ between
        the two, so the hot path is expanded afresh."""
        self.view_mode = model.other_view(self.view_mode)
        self._tree.reset_expansion()
        self._refetch_view()

    def action_sort(self) -> None:
        self.sort = model.SORTS[(model.SORTS.index(self.sort) + 1) % len(model.SORTS)]
        self.refresh_views()

    def action_chains(self) -> None:
        self.collapse_chains = not self.collapse_chains
        self.refresh_views()

    def _refetch_view(self) -> None:
        self._fetcher.refetch()
        self._update_status()

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        """A saved profile (`top --input`) has no windows to pick or compare, nothing to pause,
        refresh or detach: those keys are neither offered nor taken."""
        if action in SAVED_OFF and getattr(self.source, "saved", False):
            return False
        return True

    def action_window(self) -> None:
        if not self.source.windows:
            self.note = "a saved profile has no windows"
            self._update_status()
            return
        self.window_index = (self.window_index + 1) % len(model.WINDOWS)
        if self.window_s is None:
            self.diff = False
        self._refetch_view()

    def action_diff(self) -> None:
        if not self.source.windows:
            self.note = "a saved profile has no windows to compare"
            self._update_status()
            return
        self.diff = not self.diff
        if self.diff and self.window_s is None:
            self.window_index = 1
        self._refetch_view()

    # ---- fetching and the process ------------------------------------------------------------
    def action_pause(self) -> None:
        self.paused = not self.paused
        self._update_status()

    def action_refresh(self) -> None:
        self.fetch_now()

    def action_detach(self) -> None:
        if self.processes is None or self.pid is None:
            self.note = "nothing to detach: not connected to the daemon"
            self._update_status()
            return
        self.app.detach(self.pid)

    # ---- search ------------------------------------------------------------------------------
    def action_search(self) -> None:
        box = self.query_one("#search", Input)
        box.display = True
        box.value = self.search_query
        box.focus()

    @on(Input.Submitted, "#search")
    def _search_submitted(self, event: Input.Submitted) -> None:
        self.search_query = event.value
        event.input.display = False
        self.action_view("tree")
        if self.snap is None:
            return
        self.matches = model.search_nodes(self.snap, self.search_query, self.metric)
        self.match_index = 0
        if not self.matches:
            self.note = f"no frame matches {self.search_query!r}" if self.search_query else ""
            self._update_status()
            return
        self._go_to_match()

    def _go_to_match(self) -> None:
        node = self.matches[self.match_index]
        self.note = f"match {self.match_index + 1}/{len(self.matches)} for {self.search_query!r}"
        self.reveal(node)

    def action_next_match(self, step: int) -> None:
        if not self.matches:
            return
        self.match_index = (self.match_index + step) % len(self.matches)
        self._go_to_match()
