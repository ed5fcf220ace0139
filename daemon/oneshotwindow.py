"""What a window with an end (one-shot `profile`, `record`) admits and counts: events stamped
inside it are joined, the others counted; the target's CPU time over it tells how many CPU samples
were due. Pure: the session (daemon/session.py) feeds it the events it reads.
"""

from __future__ import annotations

import dataclasses

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
