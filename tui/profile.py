"""The profile screen of `stacklens top`: one process's (or file's) CCT in tree, flame, hotspots,
advice and source views.

No privilege. The screen keeps the state the views share and draws it; the views are panes
(tui/panes/), the fetching a worker (`Fetcher`, tui/fetcher.py) whose result lands in the reactive
`ProfileScreen.fetched`, and the keys with their actions are in `ProfileKeys` (tui/profilekeys.py).
"""

from __future__ import annotations

from typing import Any

from textual import on
from textual.app import ComposeResult
from textual.reactive import reactive
from textual.widgets import Header, Input, OptionList, Static, TabbedContent

from stacklens.tui import model
from stacklens.tui.fetcher import Fetcher, SnapshotFetched
from stacklens.tui.help import key_line
from stacklens.tui.model import Status
from stacklens.tui.panes import AdvicePane, FlamePane, HotspotCache, HotspotsPane, SourcePane, TreePane, View, put
from stacklens.tui.profilekeys import ProfileKeys
from stacklens.tui.source import Fetched, ProcessSource, SnapshotSource
from stacklens.tui.widgets import CCTView, LineTable


class ProfileScreen(ProfileKeys):
    """One process (or file): tree, flame, hotspots, advice and source views of its CCT.

    The views are panes (tui/panes/); the screen keeps the state they share, takes in what the
    `Fetcher` fetched, draws, and routes between the panes (a hotspot or a finding opens its node
    in the tree). Its keys: `ProfileKeys`."""

    fetched: reactive[Fetched | None] = reactive(None, always_update=True, init=False)

    def __init__(
        self,
        source: SnapshotSource,
        *,
        interval_s: float = 1.0,
        processes: ProcessSource | None = None,
        pid: int | None = None,
    ) -> None:
        super().__init__()
        self.source = source
        self.interval_s = interval_s
        self.processes = processes
        self.pid = pid
        self.snap: Any = None  # what the views show: the model view of `raw`, or `raw`
        self.raw: Any = None
        self.metric = ""
        self.sort = "inclusive"
        # "auto" until the first snapshot says whether it has module calls; then "model" / "full"
        self.view_mode = "auto"
        self.window_index = 0
        self.diff = False
        self.paused = False
        self.collapse_chains = True
        self.error = ""
        self.note = ""
        self.state = ""
        self.stats: dict[str, int] = {}
        self.matches: list[int] = []
        self.match_index = 0
        self.search_query = ""
        self._hot_cache = HotspotCache()
        self._fetcher = Fetcher(self, source, self._hot_cache)
        self._timer = None
        self._tree = TreePane("Tree", view=self._view, id="tree")
        self._flame = FlamePane("Flame", view=self._view, id="flame")
        self._hot = HotspotsPane("Hotspots", view=self._view, cache=self._hot_cache, id="hotspots")
        self._advice = AdvicePane("Advice", source=source, id="advice")
        self._source_pane = SourcePane("Source", id="source")

    # ---- layout ------------------------------------------------------------------------------
    def compose(self) -> ComposeResult:
        yield Header(show_clock=False, icon="≡")
        with TabbedContent(initial="tree", id="views"):
            yield self._tree
            yield self._flame
            yield self._hot
            yield self._advice
            yield self._source_pane
        yield Static(id="banner")
        yield Input(placeholder="search frames (enter: go, esc: cancel)", id="search")
        yield Static(id="status")
        # A fixed key line, not Textual's Footer: the Footer recomposes on every focus change
        # (each view switch), which cost ~100 ms per switch in docs/benchmarks/tui.md.
        yield Static(key_line(self.BINDINGS), id="keys")

    def on_mount(self) -> None:
        self.title = "stacklens"
        self.sub_title = self.source.name
        self.query_one("#search", Input).display = False
        self.query_one("#banner", Static).display = False
        self._tree.show_message("waiting for the first profile …")
        self.query_one(CCTView).focus()
        self.fetch_now()
        if self.source.live:
            self._timer = self.set_interval(self.interval_s, self._fetcher.tick)
        self._update_status()

    # ---- fetching ----------------------------------------------------------------------------
    @property
    def window_s(self) -> float | None:
        return model.WINDOWS[self.window_index]

    def fetch_now(self) -> None:
        self._fetcher.fetch_now()

    def on_snapshot_fetched(self, message: SnapshotFetched) -> None:
        if self._fetcher.arrived(message):
            if message.fetched.snapshot is not None:
                self.view_mode, self.raw = message.view, message.raw
            self.fetched = message.fetched
        self._fetcher.follow_up(message)

    def watch_fetched(self, fetched: Fetched | None) -> None:
        if fetched is None:
            return
        self.error = fetched.error
        if fetched.state:
            self.state = fetched.state
        self.stats = dict(fetched.stats)
        if fetched.final and self._timer is not None:
            self._timer.stop()
            self._timer = None
        if fetched.snapshot is not None:
            if self.snap is not None and self.snap is not fetched.snapshot:
                self._fetcher.retire(self.snap)
                self._flame.forget()
            self.snap = fetched.snapshot
            if not self.metric or self.metric not in self.snap.metrics:
                self.metric = model.default_metric(self.snap)
            self._tree.auto_expand(self.snap, self.metric)
        self.refresh_views()

    # ---- redrawing ---------------------------------------------------------------------------
    def _view(self) -> View:
        return View(self.snap, self.metric, self.diff, self.sort, self.collapse_chains, self._empty_message())

    def refresh_views(self, *, keep: model.Key | None = None) -> None:
        self._refresh_tree(keep=keep)
        active = self.query_one(TabbedContent).active
        if active == "flame":
            self._flame.refresh_flame()
        elif active == "hotspots":
            self._hot.refresh_hotspots()
        elif active == "source":
            self._refresh_source()
        elif active == "advice" and self._advice.due():
            self.load_advice()
        self._update_status()

    def _empty_message(self) -> str:
        if self.snap is None:
            return self.error or "waiting for the first profile …"
        if self.metric in self.snap.unavailable:
            why = "no agent in the process: attach with --agent" if self.metric == "gpu_time_ns" else "not measured"
            return f"{model.metric_label(self.metric)}: unavailable ({why}). Press m for another metric."
        if self.snap.node_count <= 1 or not self.snap.total(self.metric):
            what = "the profile is empty" if self.snap.node_count <= 1 else f"no {model.metric_label(self.metric)} recorded"
            more = " yet: is the process busy?" if self.source.live else "."
            return f"{what}{more} Press m to switch metric, w for another window."
        return ""

    def _refresh_tree(self, *, keep: model.Key | None = None) -> None:
        self._tree.refresh_tree(keep=keep)

    def _refresh_header(self) -> None:
        self._tree.refresh_header()

    def on_resize(self) -> None:
        self.call_after_refresh(self._refresh_header)

    def _refresh_source(self) -> None:
        self._source_pane.show(self._view(), self._tree.selected_node(), self.pid)

    def load_advice(self) -> None:
        self._advice.load(self.window_s, self.raw)

    def _update_status(self) -> None:
        unavailable = tuple(sorted(self.snap.unavailable)) if self.snap is not None else ()
        status = Status(
            source=self.source.name,
            state=self.state,
            window_s=self.window_s,
            metric=self.metric,
            diff=self.diff,
            paused=self.paused,
            nodes=self.snap.node_count if self.snap is not None else 0,
            folded=getattr(self.snap, "folded_nodes", 0) if self.snap is not None else 0,
            stats=self.stats,
            unavailable=unavailable,
            message=self.note,
            view=self.view_mode,
            unit=model.unit_of(self.snap, self.metric).label if self.snap is not None else "",
        )
        put(self.query_one("#status", Static), model.status_text(status))
        put(self.query_one("#banner", Static), self.error, layout=True, display=bool(self.error))

    # ---- routing between panes ---------------------------------------------------------------
    def reveal(self, node: int) -> None:
        """Expand the tree down to `node` and put the cursor on its row."""
        if self.snap is None:
            return
        if not self.snap.inclusive(node, self.metric):
            self.note = f"{self.snap.frame_of(node).label()} has no {model.metric_label(self.metric)}; press m"
        self._tree.reveal(self.snap, node)
        self._update_status()

    @on(LineTable.Selected, "#hot-table")
    def _hotspot_selected(self, event: LineTable.Selected) -> None:
        node = self._hot.node_at(event.index)
        if node is not None:
            self.action_view("tree")
            self.reveal(node)

    @on(OptionList.OptionSelected, "#advice-list")
    def _advice_selected(self, event: OptionList.OptionSelected) -> None:
        path = self._advice.path_at(event.option_index)
        if self.snap is None or path is None:
            return
        node = self.snap.find(list(path))
        if node is None:
            self.note = ("that path is in the full view: press v" if self.view_mode == model.MODEL
                         else "that path is not in the current profile")
            self._update_status()
            return
        self.action_view("tree")
        self.reveal(node)
