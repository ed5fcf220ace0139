"""`stacklens top`: the live terminal UI (Textual), the memray way.

No privilege of its own: it reads snapshots from the daemon over gRPC (`DaemonProcesses`), from an
in-process session (`stacklens demo`) or from a saved file. A worker thread fetches
(tui/fetcher.py); the result is posted as `SnapshotFetched` and lands in the reactive
`ProfileScreen.fetched` (tui/profile.py), whose watcher recomputes the view models (`tui.model`)
for what is on screen. Overhead: one snapshot fetch per second (pausable); rendering cost is
bounded by the visible rows, not the tree size. This module: the app, the process list and the
entry points (`run_top`, `run_local`).
"""

from __future__ import annotations

import gc
import os
import sys
from typing import Any

from textual import on, work
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import Screen
from textual.widgets import DataTable, Footer, Header, Static

from stacklens import errors
from stacklens.tui import model
from stacklens.tui.help import HelpScreen
from stacklens.tui.profile import ProfileScreen
from stacklens.tui.source import DaemonProcesses, FileSource, LocalSource, ProcessSource, SnapshotSource

GC_FULL_EVERY = 1000  # young-generation collections between full ones (Python's default: 10)


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
        for col in ("PID", "COMM", "STATE", "AGENT", "CPU", "GPU", "LAUNCH/s", "SYNC", "COST", "RANK", "PYTHON"):
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
