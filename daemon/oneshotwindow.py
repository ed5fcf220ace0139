"""A window with an end (one-shot `profile`, `record`): what it admits and counts (`Window`:
events stamped inside it are joined, the others counted; the target's CPU time over it tells how
many CPU samples were due; pure, the session feeds it the events it reads), and its close on the
session (`OneShot`: drained up to its end, then its account).
"""

from __future__ import annotations

import dataclasses
import threading
import time
from typing import Callable

from stacklens.introspect.procfs import pid_alive

# A window with an end (one-shot `profile`, `record`): BPF stamps an event (CLOCK_MONOTONIC) and
# reserves its ring record in the same program run, microseconds apart, so once an event stamped
# later than end + DRAIN_GRACE_NS has been read, or the ring was found empty after that time,
# every event stamped up to the end has been read (the ring is read in reservation order).
DRAIN_GRACE_NS = 50_000_000


@dataclasses.dataclass
class Window:
    """What a one-shot profile covers: events stamped in [start_ns, end_ns] (CLOCK_MONOTONIC,
    the clock BPF stamps with) are joined, the others counted; the target's CPU time over the
    same span (from /proc/PID/stat) tells how many CPU samples were due."""

    start_ns: int
    cpu_start_ns: int | None
    end_ns: int | None = None
    cpu_end_ns: int | None = None
    before: int = 0            # stamped before start (while the probes were being attached)
    after: int = 0             # stamped after end
    cut: int = 0               # calls that returned after end: counted up to end
    in_flight: int = 0         # syncs still waiting at the close: counted from entry up to end
    newest_ns: int = 0         # newest stamp read so far
    drained: bool = False      # every event stamped up to end_ns was read
    drain_s: float = 0.0       # from end_ns to the close
    closed: bool = False

    def admit(self, events: list) -> list:
        if not events:
            return events
        lo, hi = self.start_ns, self.end_ns
        newest = max(ev.ktime_ns for ev in events)
        if newest > self.newest_ns:
            self.newest_ns = newest
        if hi is None and min(ev.ktime_ns for ev in events) >= lo:
            return events
        keep = []
        for ev in events:
            t = ev.ktime_ns
            if t < lo:
                self.before += 1
            elif hi is not None and t > hi:
                self.after += 1
            elif hi is not None and t + ev.duration_ns > hi:
                self.cut += 1
                keep.append(ev.with_duration(hi - t))
            else:
                keep.append(ev)
        return keep

    def still_waiting(self, entered: list, returned: list) -> list:
        """Syncs entered inside the window and not returned by its end (`entered`: the probes'
        in-flight calls, read before the last drain of the ring, which gave `returned`): each
        counted as a wait from its entry up to the end."""
        done = {(ev.tid, ev.ktime_ns) for ev in returned}
        out = [ev.with_duration(self.end_ns - ev.ktime_ns) for ev in entered
               if ev.kind == "sync" and self.start_ns <= ev.ktime_ns <= self.end_ns
               and (ev.tid, ev.ktime_ns) not in done]
        self.in_flight += len(out)
        return out

    def past_end(self, ring_empty: bool, now_ns: int) -> bool:
        """True once everything stamped up to end_ns has been read (see DRAIN_GRACE_NS)."""
        if self.end_ns is None:
            return False
        limit = self.end_ns + DRAIN_GRACE_NS
        return self.newest_ns > limit or (ring_empty and now_ns > limit)


class OneShot:
    """A session's window with an end (`ProcessSession.start(window=True)`): closing it waits
    until every event stamped up to its end is read and joined, then its account goes into the
    profile's meta["window"]. `close_now` and `drain_exited` run on the session's aggregation
    thread; `close` and `done` are for the caller. `session`: the ProcessSession (its probes,
    agent, joiner, notes, thread); `cpu_ns(pid)`: the target's CPU time or None."""

    def __init__(self, session, window: Window, cpu_ns: Callable[[int], int | None], batch: int) -> None:
        self.s = session
        self.window = window
        self._cpu_ns = cpu_ns
        self._batch = batch
        self.done = threading.Event()      # closed (by the aggregation thread)
        self.abort = False                 # close with what has been read: marked not drained
        self.stats: dict[str, int] = {}    # the probes' counters at the close, and `unjoined`

    def _mark_end(self) -> None:
        w = self.window
        if w.end_ns is None:
            w.cpu_end_ns = self._cpu_ns(self.s.pid)
            w.end_ns = time.monotonic_ns()   # now: no event read so far is stamped later

    def close(self, *, cpu_end_ns: int | None, timeout_s: float, progress: Callable[[str], None] | None) -> dict:
        """End the window now, wait until every event stamped up to its end has been read and
        joined (the BPF ring, then the agent's forced flush), and return its account."""
        w, s = self.window, self.s
        if not w.closed:
            if w.end_ns is None:
                cpu = self._cpu_ns(s.pid)
                w.cpu_end_ns = cpu_end_ns if cpu_end_ns is not None else cpu
                w.end_ns = time.monotonic_ns()
            t0 = time.monotonic()
            while s.aggregating() and not self.done.wait(1.0):
                waited = time.monotonic() - t0
                if progress is not None:
                    behind = max(0.0, (w.end_ns - w.newest_ns) / 1e9) if w.newest_ns else None
                    progress(f"draining events up to the window's end ({s.joiner.stats.events} joined"
                             + (f", reading {behind:.1f}s behind" if behind else "") + ")")
                if waited > timeout_s and not self.abort:
                    self.abort = True
            if not w.closed:   # the aggregation thread ended without closing it (an error)
                if s.wait_aggregation(10):
                    self.close_now()
        if cpu_end_ns is not None and w.cpu_end_ns != cpu_end_ns:
            w.cpu_end_ns = cpu_end_ns
            s.joiner.meta["window"] = self.meta(self.stats)
        return dict(s.joiner.meta.get("window", {}))

    def drain_exited(self) -> None:
        """The target has exited: everything it sent is in the ring; read all of it."""
        self._mark_end()
        while evs := self.s.probes.poll(0, max_events=self._batch):
            for ev in self.window.admit(evs):
                self.s.joiner.on_bpf(ev)

    def close_now(self) -> None:
        """On the aggregation thread: the agent's last records, the join's end, the account."""
        w, s = self.window, self.s
        self._mark_end()
        w.drained = not self.abort or w.past_end(False, 0)
        self._charge_in_flight()
        try:
            s.drain_agent()
        except Exception as e:  # noqa: BLE001 — the window closes whatever the agent did
            s.notes.append(f"agent drain at the window's end: {e}")
        s.joiner.finish()
        pending = s.joiner.waiting_launches()   # after the forced drain: claimed by nothing
        st: dict[str, int] = {}
        try:
            st = dict(s.probes.stats()) if s.probes is not None else {}
        except Exception:  # noqa: BLE001
            pass
        js = s.joiner.stats
        st["unjoined"] = int(js.launches_unmatched + js.kernels_unmatched + pending)
        self.stats = st
        w.drain_s = max(0.0, (time.monotonic_ns() - w.end_ns) / 1e9)
        w.closed = True
        s.joiner.meta["window"] = self.meta(st)
        self.done.set()

    def _charge_in_flight(self) -> None:
        """A sync still waiting at the window's end is part of the window: its wait so far."""
        s, w = self.s, self.window
        in_flight = getattr(s.probes, "in_flight", None)
        if in_flight is None or not pid_alive(s.pid):   # an exited target waits no more
            return
        try:
            entered = in_flight()
            returned = []
            while evs := s.probes.poll(0, max_events=self._batch):
                returned += evs
            for ev in w.admit(returned) + w.still_waiting(entered, returned):
                s.joiner.on_bpf(ev)
        except Exception as e:  # noqa: BLE001 — the window closes with what it has
            s.notes.append(f"syncs in flight at the window's end: {e}")

    def meta(self, st: dict) -> dict:
        w, hz = self.window, self.s.cpu_hz
        cpu_s = None
        if w.cpu_start_ns is not None and w.cpu_end_ns is not None:
            cpu_s = round(max(0, w.cpu_end_ns - w.cpu_start_ns) / 1e9, 3)
        return {
            "start_ns": w.start_ns, "end_ns": w.end_ns,
            "seconds": round((w.end_ns - w.start_ns) / 1e9, 3),
            "target_cpu_s": cpu_s, "cpu_hz": hz,
            "expected_cpu_samples": None if cpu_s is None else round(cpu_s * hz),
            "cpu_samples": self.s.joiner.stats.cpu_samples,
            # BPF could not hand these over (ring full, sample records lost, fallback buffer full)
            "events_dropped": int(st.get("drops", 0) + st.get("lost_samples", 0) + st.get("fallback_full", 0)),
            # stamped inside the window but not read when it closed (None: not known, not drained)
            "events_late": 0 if w.drained else None,
            "drained": w.drained, "drain_s": round(w.drain_s, 3),
            "unjoined": int(st.get("unjoined", 0)),
            "before_window": w.before, "after_window": w.after,
            "cut_at_end": w.cut, "in_flight_at_end": w.in_flight,
        }
