"""`stacklens top`: the live terminal UI (Textual), the memray way.

No privilege of its own: it reads snapshots from the daemon over gRPC (`DaemonProcesses`), from an
in-process session (`stacklens demo`) or from a saved file. A worker thread fetches; the result is
posted as `SnapshotFetched` and lands in the reactive `ProfileScreen.fetched`, whose watcher
recomputes the view models (`tui.model`) for what is on screen. Overhead: one snapshot fetch per
second (pausable); rendering cost is bounded by the visible rows, not the tree size.
"""

from __future__ import annotations

import dataclasses
import gc
import os
import sys
import time
from functools import partial
from typing import Any

from textual import on, work
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.message import Message
from textual.reactive import reactive
from textual.screen import Screen
from textual.widgets import DataTable, Footer, Header, Input, OptionList, Static, TabbedContent

from stacklens import errors
from stacklens.tui import model
from stacklens.tui.help import HelpScreen, key_line
from stacklens.tui.model import Status
from stacklens.tui.panes import AdvicePane, FlamePane, HotspotCache, HotspotsPane, SourcePane, TreePane, View, put
from stacklens.tui.source import (
    DaemonProcesses,
    Fetched,
    FileSource,
    LocalSource,
    ProcessSource,
    SnapshotSource,
)
from stacklens.tui.widgets import CCTView, IcicleView, LineTable

GC_FULL_EVERY = 1000  # young-generation collections between full ones (Python's default: 10)


class SnapshotFetched(Message):
    def __init__(self, fetched: Fetched, generation: int, view: str = "", raw: Any = None) -> None:
        super().__init__()
        self.view = view  # the view `fetched.snapshot` is in (tui.model.shown_snapshot)
        self.raw = raw    # the snapshot as fetched (the full view): what the analyzer reads
        self.fetched = fetched
        self.generation = generation


class ProfileScreen(Screen):
    """One process (or file): tree, flame, hotspots, advice and source views of its CCT.

    The views are panes (tui/panes/); the screen fetches, keeps the state they share, handles the
    keys and routes between the panes (a hotspot or a finding opens its node in the tree)."""

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
        self._generation = 0
        self._fetched_at = -1e9
        self._fetch_cost = 0.0
        self._retired: list[Any] = []  # replaced snapshots, dropped by the fetch worker
        self._hot_cache = HotspotCache()
        self._inflight = False
        self._again = False
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
            self._timer = self.set_interval(self.interval_s, self._tick)
        self._update_status()

    # ---- fetching ----------------------------------------------------------------------------
    @property
    def window_s(self) -> float | None:
        return model.WINDOWS[self.window_index]

    def _tick(self) -> None:
        # Periodic refreshes never queue up behind a slow fetch, and leave the worker idle at
        # least as long as the last fetch took: decoding a 100,000-node profile costs ~1 s of
        # CPU under the GIL, and back-to-back decodes would starve the UI thread.
        if self.paused or self._inflight:
            return
        if time.monotonic() - self._fetched_at < self._fetch_cost:
            return
        self.fetch_now()

    def fetch_now(self) -> None:
        if self._inflight:
            self._again = True
            return
        self._inflight = True
        self._again = False
        self.run_worker(
            partial(self._fetch, self._generation, self.window_s, self.diff, self.view_mode),
            thread=True,
            group="fetch",
            exit_on_error=False,
        )

    def _fetch(self, generation: int, window_s: float | None, diff: bool, view: str) -> None:
        t0 = time.monotonic()
        self._retired.clear()
        # Decoding a large profile allocates millions of acyclic objects; with the collector on,
        # that triggers full collections of 0.2-0.5 s each, which hold the GIL and freeze the UI
        # (measured: docs/benchmarks/tui.md). Reference counting frees all of it anyway.
        gc_was_enabled = gc.isenabled()
        gc.disable()
        try:
            try:
                fetched = self.source.fetch(window_s, diff)
            except Exception as e:  # noqa: BLE001 - sources return errors as values; this is the backstop
                fetched = Fetched(None, error=f"fetch failed: {type(e).__name__}: {e}")
            raw = fetched.snapshot
            if raw is not None:                 # the view's transform off the UI thread too
                shown, view = model.shown_snapshot(raw, view)
                fetched = dataclasses.replace(fetched, snapshot=shown)
        finally:
            if gc_was_enabled:
                gc.enable()
        self._fetch_cost = time.monotonic() - t0
        snap, metric = fetched.snapshot, self.metric
        if snap is not None and metric in snap.metrics:
            self._hot_cache.prime(snap, metric, diff)  # off the UI thread: the hotspots open without a scan
        self.post_message(SnapshotFetched(fetched, generation, view, raw))

    def on_snapshot_fetched(self, message: SnapshotFetched) -> None:
        self._inflight = False
        self._fetched_at = time.monotonic()
        if message.generation == self._generation:
            if message.fetched.snapshot is not None:
                self.view_mode, self.raw = message.view, message.raw
            self.fetched = message.fetched
        if self._again or message.generation != self._generation:
            self.fetch_now()

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
                # freed by the next fetch, on the worker thread: dropping 100,000 nodes here
                # would stall the UI for tens of ms
                self._retired.append(self.snap)
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

    # ---- actions -----------------------------------------------------------------------------
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

    def action_metric(self, step: int) -> None:
        self.metric = model.next_metric(self.snap, self.metric, step)
        self._tree.expand_hot_if_hidden(self.snap, self.metric)
        self.refresh_views()

    def action_help(self) -> None:
        self.app.push_screen(HelpScreen([
            ("anywhere", self.BINDINGS), ("tree", CCTView.BINDINGS), ("flame", IcicleView.BINDINGS),
            ("hotspots", LineTable.BINDINGS), ("help", HelpScreen.BINDINGS)]))

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
        self._generation += 1
        self.fetch_now()
        self._update_status()

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

    def action_pause(self) -> None:
        self.paused = not self.paused
        self._update_status()

    def action_refresh(self) -> None:
        self.fetch_now()

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

    def reveal(self, node: int) -> None:
        """Expand the tree down to `node` and put the cursor on its row."""
        if self.snap is None:
            return
        if not self.snap.inclusive(node, self.metric):
            self.note = f"{self.snap.frame_of(node).label()} has no {model.metric_label(self.metric)}; press m"
        self._tree.reveal(self.snap, node)
        self._update_status()

    def action_next_match(self, step: int) -> None:
        if not self.matches:
            return
        self.match_index = (self.match_index + step) % len(self.matches)
        self._go_to_match()

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

    def action_detach(self) -> None:
        if self.processes is None or self.pid is None:
            self.note = "nothing to detach: not connected to the daemon"
            self._update_status()
            return
        self.app.detach(self.pid)

    # ---- routing between panes ---------------------------------------------------------------
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


class ProcessListScreen(Screen):
    """GPU processes on this node (attached or not); attach, detach, open."""

    BINDINGS = [
        Binding("enter", "open", "open", show=False),
        Binding("a", "attach", "attach"),
        Binding("x", "detach", "detach"),
        Binding("r", "refresh", "refresh"),
        Binding("q", "app.quit", "quit"),
        Binding("question_mark", "help", "help"),
    ]

    def __init__(self, processes: ProcessSource, *, interval_s: float = 2.0) -> None:
        super().__init__()
        self.processes = processes
        self.interval_s = interval_s
        self.rows: list[model.ProcessRow] = []
        self._cpu_readings: dict[int, tuple[int, float]] = {}  # pid → (CPU time ns, read at): for CPU%
        self.message = ""

    def compose(self) -> ComposeResult:
        yield Header(show_clock=False, icon="≡")
        with Vertical():
            yield DataTable(id="procs", cursor_type="row", zebra_stripes=True)
            yield Static(id="procs-empty", classes="empty")
        yield Static(id="banner")
        yield Static(id="status")
        yield Footer()

    def on_mount(self) -> None:
        self.title = "stacklens"
        self.sub_title = "processes"
        table = self.query_one("#procs", DataTable)
        for col in ("PID", "COMM", "STATE", "AGENT", "CPU", "GPU", "LAUNCH/s", "SYNC", "RANK", "PYTHON"):
            table.add_column(col, key=col)
        self.query_one("#banner", Static).display = False
        self.query_one("#procs-empty", Static).update("asking the daemon for processes …")
        self.refresh_list()
        self.set_interval(self.interval_s, self.refresh_list)
        table.focus()

    @work(thread=True, exclusive=True, group="procs", exit_on_error=False)
    def refresh_list(self) -> None:
        try:
            rows: list[model.ProcessRow] | str = self.processes.processes()
        except errors.StacklensError as e:
            rows = f"lost the daemon: {e}" if isinstance(e, errors.DaemonUnavailable) else str(e)
        except Exception as e:  # noqa: BLE001
            rows = f"listing processes failed: {type(e).__name__}: {e}"
        self.app.call_from_thread(self._show, rows)

    def _show(self, rows: list[model.ProcessRow] | str) -> None:
        table = self.query_one("#procs", DataTable)
        empty = self.query_one("#procs-empty", Static)
        if isinstance(rows, str):
            self.set_message(rows)
            if not self.rows:
                empty.update("no process list yet (see the message below); r retries")
            return
        if self.message.startswith(("lost the daemon", "listing")):
            self.set_message("")
        self.rows = rows
        shares, self._cpu_readings = model.cpu_shares(self._cpu_readings, rows)
        keep = table.cursor_row
        table.clear()
        for p in rows:
            table.add_row(*model.process_cells(p, shares.get(p.pid)), key=str(p.pid))
        if rows:
            table.move_cursor(row=min(keep, len(rows) - 1))
        empty.update("" if rows else "no GPU processes found and nothing attached; start a job or pass a PID")
        empty.display = not rows
        self.query_one("#status", Static).update(
            f"{len(rows)} processes · {sum(p.attached for p in rows)} attached · enter: open · a: attach · x: detach"
        )

    def set_message(self, text: str) -> None:
        self.message = text
        banner = self.query_one("#banner", Static)
        banner.update(text)
        banner.display = bool(text)

    def selected(self) -> model.ProcessRow | None:
        table = self.query_one("#procs", DataTable)
        if not self.rows or not 0 <= table.cursor_row < len(self.rows):
            return None
        return self.rows[table.cursor_row]

    def action_open(self) -> None:
        p = self.selected()
        if p is not None:
            self.app.open_process(p.pid)

    @on(DataTable.RowSelected, "#procs")
    def _row_selected(self, event: DataTable.RowSelected) -> None:
        self.action_open()

    def action_attach(self) -> None:
        p = self.selected()
        if p is not None:
            self.app.attach(p.pid)

    def action_detach(self) -> None:
        p = self.selected()
        if p is not None:
            self.app.detach(p.pid)

    def action_refresh(self) -> None:
        self.refresh_list()

    def action_help(self) -> None:
        self.app.push_screen(HelpScreen([("processes", self.BINDINGS), ("help", HelpScreen.BINDINGS)]))


class StacklensApp(App):
    CSS_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "app.tcss")  # also for subclasses
    TITLE = "stacklens"

    def __init__(
        self,
        *,
        source: SnapshotSource | None = None,
        processes: ProcessSource | None = None,
        pid: int | None = None,
        duration_s: float | None = None,
        interval_s: float = 1.0,
    ) -> None:
        super().__init__()
        if source is None and processes is None:
            raise ValueError("StacklensApp needs a snapshot source or a process source")
        self.source = source
        self.processes = processes
        self.pid = pid
        self.duration_s = duration_s
        self.interval_s = interval_s

    def on_mount(self) -> None:
        # Fetch workers decode large profiles under the GIL; a short switch interval keeps the
        # UI thread's wait for the GIL (after every select() of the event loop) at ~1 ms
        # instead of 5 ms, which otherwise adds up to hundreds of ms per key press.
        self._switch_interval = sys.getswitchinterval()
        sys.setswitchinterval(min(self._switch_interval, 0.001))
        # Each 100,000-node snapshot brings ~100,000 tracked Frame tuples, so with the default
        # thresholds a full collection (0.2-0.5 s with the GIL held, measured) ran about once
        # per snapshot. Young collections still run as usual; full ones become rare.
        self._gc_threshold = gc.get_threshold()
        gc.set_threshold(self._gc_threshold[0], self._gc_threshold[1], max(self._gc_threshold[2], GC_FULL_EVERY))
        if self.processes is not None:
            self.push_screen(ProcessListScreen(self.processes, interval_s=max(2.0, self.interval_s)))
            if self.pid is not None:
                self.open_process(self.pid)
        elif self.source is not None:
            self.push_screen(ProfileScreen(self.source, interval_s=self.interval_s, pid=self.pid))
        if self.duration_s:
            self.set_timer(self.duration_s, self.exit)

    def on_unmount(self) -> None:
        sys.setswitchinterval(self._switch_interval)
        gc.set_threshold(*self._gc_threshold)

    def open_process(self, pid: int) -> None:
        assert self.processes is not None
        self.push_screen(ProfileScreen(self.processes.open(pid), interval_s=self.interval_s, processes=self.processes, pid=pid))

    def _say(self, text: str) -> None:
        screen = self.screen
        if isinstance(screen, ProcessListScreen):
            screen.set_message(text)
        elif isinstance(screen, ProfileScreen):
            screen.note = text
            screen._update_status()

    def attach(self, pid: int) -> None:
        self._say(f"attaching to {pid} …")
        self._lifecycle(pid, True)

    def detach(self, pid: int) -> None:
        self._say(f"detaching from {pid} …")
        self._lifecycle(pid, False)

    @work(thread=True, group="lifecycle", exit_on_error=False)
    def _lifecycle(self, pid: int, attach: bool) -> None:
        assert self.processes is not None
        try:
            if attach:
                notes = self.processes.attach(pid)
                text = f"attached to {pid}" + (f" ({'; '.join(notes)})" if notes else "")
            else:
                self.processes.detach(pid)
                text = f"detached from {pid}"
        except errors.StacklensError as e:
            text = f"{'attach to' if attach else 'detach from'} {pid} failed: {e}"
        except Exception as e:  # noqa: BLE001
            text = f"{'attach to' if attach else 'detach from'} {pid} failed: {type(e).__name__}: {e}"
        self.call_from_thread(self._after_lifecycle, text)

    def _after_lifecycle(self, text: str) -> None:
        self._say(text)
        for screen in self.screen_stack:
            if isinstance(screen, ProcessListScreen):
                screen.refresh_list()


def run_top(pid: int | None, input_path: str | None, socket_path: str) -> int:
    """`stacklens top [PID] [--input FILE]`. Errors before the UI starts raise `StacklensError`."""
    if input_path:
        app = StacklensApp(source=FileSource.open(input_path))
    else:
        processes = DaemonProcesses.connect(socket_path)
        if pid is not None:
            processes.check_known(pid)
        app = StacklensApp(processes=processes, pid=pid)
    app.run()
    return 0 if app.return_code is None else app.return_code


def run_local(session: Any, title: str, duration_s: float | None) -> int:
    """`stacklens demo`: the same UI over an in-process session object (`.snapshot(window_s)`)."""
    app = StacklensApp(source=LocalSource(session, name=title), pid=getattr(session, "pid", None), duration_s=duration_s)
    app.run()
    return 0 if app.return_code is None else app.return_code


if __name__ == "__main__":  # pragma: no cover - handy: python -m stacklens.tui.app FILE
    sys.exit(run_top(None, sys.argv[1] if len(sys.argv) > 1 else None, os.environ.get("STACKLENS_SOCKET", "")))
