"""The probes' estimated cost to each attached process, as a share of its CPU time (`stacklens
ps`, issue 42): what they cost a decode server is what decides whether it stays attached.

cost = API probe hits x (trap + the API program's run time per hit)
     + operator probe hits x (trap + the operator program's run time per hit)
     + CPU samples x the sampler program's run time per sample

over the last STEP_S or more (at most KEEP_S), divided by the CPU time the process used meanwhile.
Hits are the process's own counters (bpf/session.py stats); run times are the programs' means per
hit from the kernel's BPF statistics (bpf/costs.py RunStats, sampled while anything is attached:
NodeCosts; a program shared by several processes has one mean); the trap is timed once per daemon
in a process of its own (bpf/costs.py measure_trap_ns). What is not measured is not in the number and is said: the
agent's cost (CUPTI, its sampler), and the trap where it could not be timed.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

log = logging.getLogger(__name__)

STEP_S = 2.0        # the estimate spans at least this long (a shorter one is mostly noise)
KEEP_S = 30.0       # ... and at most this long: a recent rate, not the session's average
STATS_EVERY_S = 10.0   # BPF run-time statistics are on for STATS_ON_S of every STATS_EVERY_S
STATS_ON_S = 1.0


@dataclass(frozen=True)
class Reading:
    """One process's counters at one time (ProcessSession.cost_reading)."""
    t: float                                   # time.monotonic()
    cpu_ns: int | None                         # the process's utime + stime
    api_hits: int
    op_hits: int
    samples: int
    runs: dict[str, tuple[int, int]] = field(default_factory=dict)   # program -> (run_time_ns, run_cnt)


@dataclass(frozen=True)
class Estimate:
    share: float | None          # of the process's CPU time; None: not measured (why says why)
    seconds: float               # the span it covers
    why: str = ""                # what it leaves out, or why there is none


class NodeCosts:
    """The node-wide parts: BPF run-time statistics on for STATS_ON_S of every STATS_EVERY_S while
    sessions are attached (they cost ~130 ns per launch-probe hit while on, measured on the
    stand-in: docs/benchmarks/launch-cost.md; a program's mean per hit is the same sampled), and
    the trap timed once (on a thread of its own: the first attach does not wait for it)."""

    def __init__(self, measure_trap: Callable[[], float] | None = None, run_stats: Callable[[], object] | None = None):
        from stacklens.bpf.costs import RunStats, measure_trap_ns

        self._measure = measure_trap or measure_trap_ns
        self._run_stats = run_stats or RunStats
        self._lock = threading.Lock()
        self._users = 0
        self._wake = threading.Condition(self._lock)
        self._cycling: threading.Thread | None = None
        self.stats_error = ""
        self.trap_ns: float | None = None
        self.trap_error = ""
        self._timing: threading.Thread | None = None

    def hold(self) -> None:
        """A session attached: statistics sampled (from the first), the trap timed (once)."""
        with self._lock:
            self._users += 1
            if self._cycling is None:
                self._cycling = threading.Thread(target=self._cycle, name="stacklens-bpf-stats", daemon=True)
                self._cycling.start()
            if self._timing is None:
                self._timing = threading.Thread(target=self._time_trap, name="stacklens-trap-cost", daemon=True)
                self._timing.start()

    def release(self) -> None:
        with self._lock:
            self._users = max(0, self._users - 1)
            self._wake.notify_all()

    def _cycle(self) -> None:
        while True:
            with self._lock:
                if not self._users:
                    self._cycling = None
                    return
            try:
                stats = self._run_stats()
            except OSError as e:
                self.stats_error = f"BPF run-time statistics unavailable: {e}"
                log.warning("%s", self.stats_error)
                with self._lock:
                    self._cycling = None
                return
            try:
                with self._lock:
                    self._wake.wait_for(lambda: not self._users, timeout=STATS_ON_S)
            finally:
                stats.close()
            with self._lock:
                self._wake.wait_for(lambda: not self._users, timeout=STATS_EVERY_S - STATS_ON_S)

    def _time_trap(self) -> None:
        try:
            self.trap_ns = self._measure()
            log.info("uprobe trap: %.0f ns per hit on this machine", self.trap_ns)
        except Exception as e:  # noqa: BLE001 — the estimate says the trap is not in it
            self.trap_error = f"{type(e).__name__}: {e}"
            log.warning("uprobe trap cost not measured: %s", self.trap_error)


class CostMeter:
    """One session's readings, and its estimate over the last STEP_S..KEEP_S."""

    def __init__(self, node: NodeCosts) -> None:
        self.node = node
        self._marks: collections.deque[Reading] = collections.deque()

    def estimate(self, now: Reading) -> Estimate:
        self._marks.append(now)
        while len(self._marks) > 2 and now.t - self._marks[1].t >= STEP_S and now.t - self._marks[0].t > KEEP_S:
            self._marks.popleft()
        first = self._marks[0]
        span = now.t - first.t
        if span < STEP_S:
            return Estimate(None, span, f"measuring (the first {STEP_S:g} s)")
        if now.cpu_ns is None or first.cpu_ns is None or now.cpu_ns <= first.cpu_ns:
            return Estimate(None, span, "the process used no CPU time that could be read")
        trap = self.node.trap_ns
        cost = 0.0
        for hits, prog, trapped in ((now.api_hits - first.api_hits, "api", True),
                                    (now.op_hits - first.op_hits, "op", True),
                                    (now.samples - first.samples, "cpu", False)):
            if hits <= 0:
                continue
            mean = _mean_run(now.runs.get(prog))
            if mean is None:
                return Estimate(None, span, self.node.stats_error or "measuring (the programs' run time is sampled "
                                f"{STATS_ON_S:g} s in every {STATS_EVERY_S:g} s)")
            cost += hits * (mean + ((trap or 0.0) if trapped else 0.0))
        why = "probes only (the agent's cost is not measured)"
        if trap is None:
            why += "; the uprobe trap is not in it (" + (self.node.trap_error or "still being timed") + ")"
        return Estimate(cost / (now.cpu_ns - first.cpu_ns), span, why)


def _mean_run(run: tuple[int, int] | None) -> float | None:
    """A program's mean run time per hit, over every run timed so far (None: none timed yet)."""
    if run is None or run[1] <= 0:
        return None
    return run[0] / run[1]


class Overheads:
    """The daemon's meters, one per attached session (started when it is installed, ended when it
    is retired), and the node-wide parts they share."""

    def __init__(self, node: NodeCosts | None = None) -> None:
        self._node = node
        self._lock = threading.Lock()
        self._meters: dict[int, CostMeter] = {}     # id(session) -> its meter

    @property
    def node(self) -> NodeCosts:
        if self._node is None:
            self._node = NodeCosts()
        return self._node

    def start(self, s) -> None:
        if getattr(s, "probes", None) is None or not hasattr(s.probes, "program_fds"):
            return      # a session without real probes (tests' fakes): nothing to meter
        self.node.hold()
        with self._lock:
            self._meters[id(s)] = CostMeter(self.node)

    def end(self, s) -> None:
        with self._lock:
            meter = self._meters.pop(id(s), None)
        if meter is not None:
            self.node.release()

    def of(self, s) -> Estimate | None:
        """The session's estimate now; None when it is not metered."""
        with self._lock:
            meter = self._meters.get(id(s))
        if meter is None:
            return None
        reading = read_costs(s)
        if reading is None:
            return None
        with self._lock:
            return meter.estimate(reading)


def read_costs(s) -> Reading | None:
    """A ProcessSession's counters now (None once its probes are gone)."""
    from stacklens.bpf.costs import RunStats
    from stacklens.daemon.session import process_cpu_ns

    st = s.stats()
    probes = s.probes
    if probes is None:
        return None
    runs = {}
    try:
        for kind, fd in probes.program_fds().items():
            runs[kind] = RunStats.of(fd)
    except OSError:
        return None      # detached meanwhile
    samples = int(st.get("bpf_samples", 0))
    return Reading(time.monotonic(), process_cpu_ns(s.pid), api_hits=max(0, int(st.get("bpf_events", 0)) - samples),
                   op_hits=int(st.get("bpf_op_calls", 0)), samples=samples, runs=runs)
