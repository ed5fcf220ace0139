"""Benchmark of `stacklens top`: key-press latency and memory with a 100,000-node snapshot that
changes every second.

No privilege. Runs the real app headless (Textual's pilot, which still lays out and renders every
frame) against a source that hands out a new 100,000-node snapshot each second, either prebuilt
(`--mode objects`) or decoded from the daemon's wire format each time like `DaemonSnapshotSource`
(`--mode wire`, see below), competing with the UI thread for the GIL. Key latency = time from handing the key event to the app (as
the terminal driver does) until the end of the first frame composited after the last change
the key caused, rendered to terminal bytes. Memory = RSS after a gc, sampled every 5 s.

    .venv/bin/python benchmarks/bench_tui.py --seconds 120 --mode wire
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import gzip
import json
import os
import platform
import statistics
import sys
import time

from textual import events

from stacklens.cct.export import decode_profile, encode_profile, to_json
from stacklens.tui.app import StacklensApp
from stacklens.tui.source import Fetched
from stacklens.tui.testing import synthetic_snapshot
from stacklens.tui.widgets import CCTView

KEYS = [
    ("down", "cursor down"),
    ("down", "cursor down"),
    ("pagedown", "page down"),
    ("enter", "expand/collapse"),
    ("e", "expand hot path"),
    ("m", "switch metric"),
    ("s", "sort"),
    ("M", "switch metric back"),
    ("f", "flame view"),
    ("down", "flame: level down"),
    ("t", "tree view"),
    ("h", "hotspots view"),
    ("t", "tree view"),
    ("c", "chains on/off"),
    ("c", "chains on/off"),
    ("up", "cursor up"),
]


def rss_mib() -> float:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / (1 << 20)


class ChangingSource:
    name = "bench: 100,000 nodes"
    live = True
    windows = True

    def __init__(self, n_nodes: int, mode: str, variants: int = 3) -> None:
        self.mode = mode
        snaps = [synthetic_snapshot(n_nodes, seed=i) for i in range(variants)]
        self.nodes = snaps[0].node_count
        if mode == "wire":
            self.blobs = [encode_profile(s) for s in snaps]
            self.snaps = []
        elif mode == "wire-json":
            self.blobs = [gzip.compress(json.dumps(to_json(s)).encode(), 1) for s in snaps]
            self.snaps = []
        else:
            self.snaps = snaps
        self.i = 0
        self.fetch_s: list[float] = []

    def fetch(self, window_s, diff=False):
        t0 = time.perf_counter()
        self.i += 1
        if self.mode != "objects":
            snap = decode_profile(self.blobs[self.i % len(self.blobs)])
        else:
            snap = self.snaps[self.i % len(self.snaps)]
        self.fetch_s.append(time.perf_counter() - t0)
        return Fetched(snap, "attached", {"drops": 0})

    def advice(self, window_s, snapshot):
        return []


class TimedApp(StacklensApp):
    """Records when each frame has been composited and rendered to terminal bytes.

    Headless apps skip writing to a terminal; rendering the update to segments here puts that
    cost back, so a "frame" below is what a real terminal would be sent.
    """

    frames: list[float]
    frame_cpu: dict[float, float]  # frame end -> the UI thread's CPU time then
    actions: list[float]
    effects: list[float]

    def _display(self, screen, renderable) -> None:
        if renderable is not None and hasattr(renderable, "render_segments"):
            renderable.render_segments(self.console)
        super()._display(screen, renderable)
        self.frames.append(time.perf_counter())
        self.frame_cpu[self.frames[-1]] = time.thread_time()

    async def _dispatch_action(self, namespace, action_name, params) -> bool:
        try:
            return await super()._dispatch_action(namespace, action_name, params)
        finally:
            self.actions.append(time.perf_counter())


def record_effects(app) -> None:
    """Timestamp (synchronously, inside the app) every method that changes what a key shows."""
    from stacklens.tui.app import ProfileScreen
    from stacklens.tui.panes.tree import TreePane
    from stacklens.tui.widgets import IcicleView, LineTable

    targets = [
        (ProfileScreen, ("_refresh_tree", "_on_view", "_update_status")),
        (TreePane, ("refresh_tree",)),   # a toggle redraws the tree pane itself
        (CCTView, ("move_to",)),
        (IcicleView, ("_changed",)),
        (LineTable, ("action_cursor",)),
    ]
    for cls, names in targets:
        for name in names:
            original = getattr(cls, name)

            def timed(self, *a, __original=original, **kw):
                try:
                    return __original(self, *a, **kw)
                finally:
                    if not app.refreshing:
                        app.effects.append(time.perf_counter())

            setattr(cls, name, timed)

    # Redraws for a new snapshot are not a key's effect: counting them charged a key that
    # changes nothing (enter on a leaf row) with the next periodic refresh, up to `settle` later.
    original_watch = ProfileScreen.watch_fetched

    def watch_fetched(self, fetched):
        app.refreshing = True
        try:
            return original_watch(self, fetched)
        finally:
            app.refreshing = False

    ProfileScreen.watch_fetched = watch_fetched


async def press_and_time(app, key: str, timeout: float = 5.0, settle: float = 0.5) -> tuple[float, float] | None:
    """Seconds from sending `key` to the end of the first frame drawn after the last change it
    caused (its action, and the screen updates that action led to), and the UI thread's CPU
    seconds in that time (the benchmark runs in the UI thread; on a loaded machine the wall
    time also counts waiting for a CPU and for the GIL). All ends are recorded inside the app,
    synchronously: a poller in the same event loop would see them late. None: the action did
    not run within `timeout`.
    """
    app.actions.clear()
    app.frame_cpu.clear()
    cpu0 = time.thread_time()
    t0 = time.perf_counter()
    event = events.Key(key, key if len(key) == 1 else None)
    event.set_sender(app)
    app._driver.send_message(event)
    while not app.actions:
        if time.perf_counter() - t0 > timeout:
            return None
        await asyncio.sleep(0.001)
    # let the posted messages run; changes up to `settle` later count as the key's
    await asyncio.sleep(0.05)
    while True:
        last_change = max([app.actions[0]] + [t for t in app.effects if t0 <= t <= t0 + settle])
        frame = next((t for t in app.frames if t >= last_change), None)
        if frame is not None:
            return frame - t0, app.frame_cpu.get(frame, cpu0) - cpu0
        if time.perf_counter() - last_change > settle:
            return last_change - t0, 0.0
        await asyncio.sleep(0.001)


async def run(args) -> dict:
    src = ChangingSource(args.nodes, args.mode)
    app = TimedApp(source=src, interval_s=1.0)
    app.frames = []
    app.frame_cpu = {}
    app.refreshing = False
    app.actions = []
    app.effects = []
    record_effects(app)
    lat: dict[str, list[float]] = {}
    cpu: dict[str, list[float]] = {}
    missed: dict[str, int] = {}
    rss: list[tuple[float, float]] = []
    async with app.run_test(size=(args.width, args.height)) as pilot:
        for _ in range(3):
            await pilot.pause()
            await app.workers.wait_for_complete()
        await pilot.pause()
        view = app.screen.query_one(CCTView)
        assert view.rows, "the tree should show the first snapshot"
        t_start = time.monotonic()
        next_rss = 0.0
        k = 0
        while time.monotonic() - t_start < args.seconds:
            key, what = KEYS[k % len(KEYS)]
            k += 1
            timed = await press_and_time(app, key)
            if timed is None:
                missed[what] = missed.get(what, 0) + 1
            else:
                lat.setdefault(what, []).append(timed[0])
                cpu.setdefault(what, []).append(timed[1])
            del app.frames[:-1]
            app.effects.clear()
            now = time.monotonic() - t_start
            if now >= next_rss:
                gc.collect()
                rss.append((now, rss_mib()))
                next_rss += 5.0
            await asyncio.sleep(args.gap)
        snaps_seen = src.i
        lines = view.visible_lines()
    allv = [v for vs in lat.values() for v in vs]
    return {"latency": lat, "cpu": cpu, "all_cpu": [v for vs in cpu.values() for v in vs], "missed": missed, "all": allv, "rss": rss, "fetches": snaps_seen, "fetch_s": src.fetch_s, "nodes": src.nodes, "lines": lines}


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nodes", type=int, default=100_000)
    p.add_argument("--seconds", type=float, default=60.0)
    p.add_argument("--mode", choices=("objects", "wire", "wire-json"), default="wire")
    p.add_argument("--gap", type=float, default=0.2, help="seconds between key presses")
    p.add_argument("--width", type=int, default=160)
    p.add_argument("--height", type=int, default=50)
    args = p.parse_args()
    r = asyncio.run(run(args))
    ms = lambda s: f"{1000 * s:.1f}"  # noqa: E731
    print(f"# stacklens top benchmark: {r['nodes']:,} nodes, mode={args.mode}, {args.seconds:g} s, {args.width}x{args.height}")
    print(f"machine: {platform.machine()} {platform.processor() or ''} {os.cpu_count()} CPUs, Python {platform.python_version()}, {platform.platform()}")
    print(f"snapshots received: {r['fetches']} (fetch+decode median {ms(statistics.median(r['fetch_s']))} ms)")
    print(f"load average at the end: {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    print(f"key presses: {len(r['all'])}, latency ms: median {ms(statistics.median(r['all']))}, p95 {ms(pct(r['all'], 0.95))}, p99 {ms(pct(r['all'], 0.99))}, max {ms(max(r['all']))}")
    c = r["all_cpu"]
    print(f"UI-thread CPU per key, ms: median {ms(statistics.median(c))}, p95 {ms(pct(c, 0.95))}, p99 {ms(pct(c, 0.99))}, max {ms(max(c))}")
    print("| key | n | median ms | p95 ms | max ms | UI CPU median ms | UI CPU p95 ms |")
    print("|---|---|---|---|---|---|---|")
    for what, vs in r["latency"].items():
        cs = r["cpu"][what]
        print(f"| {what} | {len(vs)} | {ms(statistics.median(vs))} | {ms(pct(vs, 0.95))} | {ms(max(vs))} | {ms(statistics.median(cs))} | {ms(pct(cs, 0.95))} |")
    if r["missed"]:
        print(f"keys without a visible effect within 5 s (not counted): {r['missed']}")
    print("RSS MiB over time: " + ", ".join(f"{t:.0f}s={m:.0f}" for t, m in r["rss"]))
    if len(r["rss"]) >= 4:
        third = max(1, len(r["rss"]) // 3)
        early = statistics.mean(m for _, m in r["rss"][third : 2 * third])
        late = statistics.mean(m for _, m in r["rss"][-third:])
        print(f"RSS middle third {early:.0f} MiB, last third {late:.0f} MiB, drift {late - early:+.0f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
