"""The GPU side of an attached process now, as the probes saw it (`stacklens dump`, the
GetInFlight RPC): the return-probed calls entered and not returned (a sync or a collective still
waiting: since when, under which line) and each thread's last kernel launch (how long ago, from
where). Whether that kernel has finished is not known here (the probes see launches).

Read on the session's aggregation thread (`ProcessSession.in_flight` asks it), which owns the
joiner.
"""

from __future__ import annotations

import time


def read_in_flight(probes, joiner) -> dict[str, list[dict]]:
    now = time.monotonic_ns()
    entered = getattr(probes, "in_flight", None)
    names = joiner.thread_names()
    waits = [{"tid": ev.tid, "thread": names.get(ev.tid, ""), "api": ev.api,
              "since_s": max(0, now - ev.ktime_ns) / 1e9,
              "path": [f.label() for f in joiner.context_of(ev)]}
             for ev in (entered() if entered is not None else [])]
    launches = [{"tid": tid, "thread": names.get(tid, ""), "kernel": path[-1].name if path else "",
                 "ago_s": max(0, now - t) / 1e9, "path": [f.label() for f in path]}
                for tid, (t, path) in sorted(joiner.last_launch.items())]
    return {"waiting": waits, "last_launches": launches}
