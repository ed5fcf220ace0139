"""A profile window through stacklensd (`stacklens profile` while the daemon runs): a lease on the
process's session held by one client call, with an end.

The window holds the session ("window N" among its holders, daemon/core.py): it attaches the
process when no one holds it (with the window's options), or shares the session held already. Its
profile is the session's tree at its end minus its tree at its start, each taken at an exact
edge (`ProcessSession.edge`: the BPF ring read past it, the agent's GPU records flushed at it and
joined), so it holds the GPU time a one-shot window of the same length holds. The window ends at
its deadline, when its client asks (`end_window`: Ctrl-C in `stacklens profile`; the profile
covers it up to then), when the process exits (the profile then covers it up to its exit) or
when its client goes away (`gone`: the RPC was cancelled, the client killed: no profile); then it
lets go of the session, which is detached if nothing else holds it.

A held session whose options differ: one without the agent cannot measure GPU time, so a window
that asks for the agent is refused with what to do; another sampling rate or operator probes off
are said in the notes (the window's expected sample count uses the session's rate).
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
from dataclasses import dataclass
from typing import Callable, Iterator

from stacklens.cct import Snapshot, growth
from stacklens.daemon.join.rename import META_KEY, name_launches
from stacklens.daemon.session import ProcessSession, process_cpu_ns
from stacklens.errors import InputError, NoSuchProcess, StacklensError

_IDS = itertools.count(1)
MAX_WINDOW_S = 24 * 3600.0
_open_lock = threading.Lock()
_open: dict[int, tuple[int, threading.Event]] = {}   # window id -> (its PID, set: end it now)


class WindowAbandoned(StacklensError):
    """The window's client went away: the window ended early, its profile goes nowhere."""

    grpc_code = "CANCELLED"


@dataclass(frozen=True)
class WindowSpec:
    pid: int
    duration_s: float
    agent: bool = False
    cpu_hz: int = 99
    ops: bool = True

    def check(self) -> None:
        if not 0 < self.duration_s <= MAX_WINDOW_S:
            raise InputError(f"a window lasts more than 0 and at most {MAX_WINDOW_S:.0f} s (got {self.duration_s!r})")


def run_window(daemon, spec: WindowSpec, *, say: Callable[[str | int], None], gone: threading.Event) -> Snapshot:
    """The window `spec` on `daemon` (core.Daemon); `say` hears its id (an int, first: what
    `end_window` names) and its steps, `gone` set ends it early (WindowAbandoned). The snapshot's
    meta["window"] is its account (cli/oneshot.py assess)."""
    spec.check()
    wid, end_now = next(_IDS), threading.Event()
    holder = f"window {wid}"
    with _open_lock:
        _open[wid] = (spec.pid, end_now)
    try:
        say(wid)
        op, _joined = daemon.begin_attach(spec.pid, agent=spec.agent, cpu_hz=spec.cpu_hz, ops=spec.ops,
                                          join=True, holder=holder)
        try:
            _follow_attach(op, say, gone)
            s = daemon.session(spec.pid)
            if not isinstance(s, ProcessSession) or s.state != "attached":
                raise NoSuchProcess(f"the session of {spec.pid} ended before the window began ({s.state})")
            notes = _check_options(s, spec)
            return _collect(s, spec, notes, say, gone, end_now)
        finally:
            daemon.release(spec.pid, holder)
    finally:
        with _open_lock:
            del _open[wid]


def end_window(pid: int, window_id: int) -> str:
    """Ends the open window `window_id` of `pid` now: its profile covers it up to now."""
    with _open_lock:
        pid_of, end_now = _open.get(window_id, (None, None))
    if end_now is None or pid_of != pid:
        raise NoSuchProcess(f"no profile window {window_id} is open on {pid} (it ended, or it is another's)")
    end_now.set()
    return f"window {window_id} on {pid} ends now"


def window_steps(daemon, spec: WindowSpec, gone: threading.Event) -> Iterator[int | str | Snapshot]:
    """`run_window` on a thread of its own: its id, its steps as they come, then its profile (its
    error raised here)."""
    steps: queue.Queue = queue.Queue()
    result: dict = {}

    def run() -> None:
        try:
            result["snap"] = run_window(daemon, spec, say=steps.put, gone=gone)
        except BaseException as e:  # noqa: BLE001 — raised on the caller's thread below
            result["error"] = e
        finally:
            steps.put(None)

    threading.Thread(target=run, name=f"stacklens-window-{spec.pid}", daemon=True).start()
    while (phase := steps.get()) is not None:
        yield phase
    if "error" in result:
        raise result["error"]
    yield result["snap"]


def _follow_attach(op, say: Callable[[str], None], gone: threading.Event) -> None:
    seen = -1
    while True:
        ended = op.wait(seen, 0.2)
        if op.step != seen:
            seen = op.step
            if not ended:
                say(f"stacklensd: {op.phase}")
        if ended:
            op.result()             # the attach's error, raised
            return
        if gone.is_set():
            raise WindowAbandoned("the client went away during the attach")


def _check_options(s: ProcessSession, spec: WindowSpec) -> list[str]:
    """What the held session gives this window, as notes; an agent it lacks is refused."""
    if spec.agent and not s.want_agent:
        raise InputError(f"{spec.pid} is attached in stacklensd without the agent, so a window on it measures no GPU "
                         f"time: `stacklens detach {spec.pid}` and profile again, or profile with --no-daemon")
    notes = []
    if s.cpu_hz != spec.cpu_hz:
        notes.append(f"CPU samples at {s.cpu_hz} Hz, the rate of the session held already (not {spec.cpu_hz} Hz)")
    if spec.ops and not s.ops:
        notes.append("no operator frames: the session held already has the libtorch operator probes off")
    return notes


def _collect(s: ProcessSession, spec: WindowSpec, notes: list[str], say, gone: threading.Event,
             end_now: threading.Event) -> Snapshot:
    """The window is [t0, t1] exactly: each edge's snapshot holds what happened up to its time,
    however long it took to get (daemon/edges.py)."""
    cpu0, t0 = process_cpu_ns(spec.pid), time.monotonic_ns()
    say("flushing to the window's start")
    first, missing0 = s.edge(t_ns=t0)
    say(f"collecting for {spec.duration_s:g}s")
    end = t0 / 1e9 + spec.duration_s
    while time.monotonic() < end and s.state == "attached" and not end_now.is_set():
        if gone.wait(min(0.05, max(0.0, end - time.monotonic()))):
            raise WindowAbandoned("the client went away during the window")
    exited = s.state != "attached"
    early = not exited and end_now.is_set() and time.monotonic() < end
    t1 = time.monotonic_ns()
    cpu1 = process_cpu_ns(spec.pid) if not exited else None
    say("flushing to the window's end")
    last, missing1 = s.edge(t_ns=t1)
    # a kernel named during the window: the start's tree gets the same name before the difference
    first = name_launches(first, (last.meta.get(META_KEY) or {}).get("renamed", {}))
    snap = growth(last, first)
    snap.meta.clear()
    snap.meta.update(last.meta)
    snap.meta.pop("window_s", None)          # the session's age: this window's length is below
    seconds = (t1 - t0) / 1e9
    window = {"seconds": seconds, "start_ns": t0, "end_ns": t1, "cpu_hz": s.cpu_hz,
              "target_cpu_s": None if cpu0 is None or cpu1 is None else (cpu1 - cpu0) / 1e9,
              "cpu_samples": snap.total("cpu_samples") if "cpu_samples" in snap.metrics else 0,
              "drained": not (missing0 or missing1), "events_late": None, "through": "stacklensd"}
    if window["target_cpu_s"] is not None:
        window["expected_cpu_samples"] = round(window["target_cpu_s"] * s.cpu_hz)
    if exited:
        window["target_exited"] = True
    if early:
        window["ended_early"] = True     # said by cli/oneshot.py assess
    out = snap.meta["notes"] = list(snap.meta.get("notes", [])) + notes
    for edge, missing in (("start", missing0), ("end", missing1)):
        if missing:
            out.append(f"the window's {edge} is not exact: {'; '.join(missing)}")
    out.append("collected through stacklensd (a window on its session: GPU records flushed at both edges)")
    snap.meta["window"] = window
    snap.meta["window_s"] = round(seconds, 6)
    return snap
