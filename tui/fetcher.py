"""The profile screen's fetch worker: snapshots fetched off the UI thread, posted as `SnapshotFetched`.

No privilege. One fetch at a time, in a worker thread: the source's fetch (gRPC, a local session or
a file), the view's transform (`tui.model.shown_snapshot`) and the hotspots' scan all run there,
so the UI thread only swaps the result in. Periodic fetches leave the worker idle at least as long
as the last fetch took (decoding a 100,000-node profile costs ~1 s of CPU under the GIL).
"""

from __future__ import annotations

import dataclasses
import gc
import time
from functools import partial
from typing import Any

from textual.message import Message
from textual.screen import Screen

from stacklens.tui import model
from stacklens.tui.panes import HotspotCache
from stacklens.tui.source import Fetched, SnapshotSource



class SnapshotFetched(Message):
    def __init__(self, fetched: Fetched, generation: int, view: str = "", raw: Any = None) -> None:
        super().__init__()
        self.view = view  # the view `fetched.snapshot` is in (tui.model.shown_snapshot)
        self.raw = raw    # the snapshot as fetched (the full view): what the analyzer reads
        self.fetched = fetched
        self.generation = generation


class Fetcher:
    """Fetches for `screen` what it shows now (its window, diff, view and metric), one fetch in
    flight; a fetch asked for meanwhile runs when that one is in. A change of what is fetched
    (`refetch`) starts a new generation: results of older ones are dropped and fetched again."""

    def __init__(self, screen: Screen, source: SnapshotSource, hot_cache: HotspotCache) -> None:
        self._screen = screen
        self._source = source
        self._hot_cache = hot_cache
        self.generation = 0
        self._fetched_at = -1e9
        self._fetch_cost = 0.0
        self._retired: list[Any] = []  # replaced snapshots, dropped by the fetch worker
        self._inflight = False
        self._again = False

    def tick(self) -> None:
        # Periodic refreshes never queue up behind a slow fetch, and leave the worker idle at
        # least as long as the last fetch took: decoding a 100,000-node profile costs ~1 s of
        # CPU under the GIL, and back-to-back decodes would starve the UI thread.
        if self._screen.paused or self._inflight:
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
        s = self._screen
        s.run_worker(
            partial(self._fetch, self.generation, s.window_s, s.diff, s.view_mode),
            thread=True,
            group="fetch",
            exit_on_error=False,
        )

    def refetch(self) -> None:
        """What is fetched changed (window, diff, view): a new generation, fetched now."""
        self.generation += 1
        self.fetch_now()

    def retire(self, snap: Any) -> None:
        """A snapshot replaced on screen: freed by the next fetch, on the worker thread (dropping
        100,000 nodes on the UI thread would stall it for tens of ms)."""
        self._retired.append(snap)

    def arrived(self, message: SnapshotFetched) -> bool:
        """A fetch is in: True if it is of the current generation (the screen takes it)."""
        self._inflight = False
        self._fetched_at = time.monotonic()
        return message.generation == self.generation

    def follow_up(self, message: SnapshotFetched) -> None:
        """After a fetch is in: fetch again if that was asked meanwhile, or it was of an old generation."""
        if self._again or message.generation != self.generation:
            self.fetch_now()

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
                fetched = self._source.fetch(window_s, diff)
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
        snap, metric = fetched.snapshot, self._screen.metric
        if snap is not None and metric in snap.metrics:
            self._hot_cache.prime(snap, metric, diff)  # off the UI thread: the hotspots open without a scan
        self._screen.post_message(SnapshotFetched(fetched, generation, view, raw))
