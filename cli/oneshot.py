"""One-shot profiling without a daemon (`stacklens profile`, `stacklens record`), like `py-spy record`.

Requires root (BPF; ptrace for `record` and --agent). The target is left as it was when this returns.

The profile covers a window with an end: collecting stops at the deadline (or when the target
exits), then every event stamped before it is drained and joined (the BPF ring, the agent's
forced flush), and only then is the snapshot taken. Its account — the real window, the target's
CPU time over it (/proc/PID/stat), events dropped, late and unjoined — is the snapshot's
meta["window"]; `assess()` turns it into notes and, for a profile that is empty or short
although the target ran on CPU, an `IncompleteProfile` error.
"""

from __future__ import annotations

import math
import sys
import threading
import time
from typing import Callable, TextIO

from stacklens.cct import Snapshot
from stacklens.daemon.core import check_target
from stacklens.daemon.session import ProcessSession, process_start
from stacklens.errors import IncompleteProfile, NoSuchProcess, StacklensError
from stacklens.render.textreport import window_line

# A window whose CPU samples fall short of rate × CPU time by more than this is reported as an
# error: sampling itself is within a few percent (docs/benchmarks/oneshot.md).
SHORTFALL = 0.25           # a profile short of more than this share of the samples due is incomplete…
CHANCE_SD = 4              # …and short by more than this many standard deviations of a Poisson count:
                           # a target running in bursts gets a sample count that varies by about
                           # √due (15 where 21 were due is chance; 0.003% of windows fall 4 sd short)
MIN_EXPECTED = 20          # below this many samples due, a shortfall is not told from chance
NO_CPU_S = 0.02            # a target under this much CPU time in the window "used no CPU"


class Progress:
    """Phase lines on a stream (stderr), each with the time since start; while one phase lasts,
    a reminder every `every_s` so a slow attach (13-77 s under load) does not look hung."""

    def __init__(self, stream: TextIO | None = None, every_s: float = 5.0, label: str = "") -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.every_s = every_s
        self.label = label
        self.t0 = time.monotonic()
        self._phase = ""
        self._since = self.t0
        self._done = threading.Event()
        self._ticker: threading.Thread | None = None

    def __call__(self, phase: str) -> None:
        self._phase, self._since = phase, time.monotonic()
        self._line(phase)
        if self._ticker is None and self.every_s > 0:
            self._ticker = threading.Thread(target=self._tick, name="stacklens-progress", daemon=True)
            self._ticker.start()

    def _line(self, text: str) -> None:
        try:
            self.stream.write(f"stacklens: [{time.monotonic() - self.t0:6.1f}s] {self.label}{text}\n")
            self.stream.flush()
        except (OSError, ValueError):
            pass

    def _tick(self) -> None:
        while not self._done.wait(self.every_s):
            if self._phase and time.monotonic() - self._since >= self.every_s:
                self._line(f"{self._phase} (still, {time.monotonic() - self._since:.0f}s in this step)")

    def quiet(self) -> None:
        """No reminders (a phase whose length the user chose, e.g. collecting)."""
        self._phase = ""

    def close(self) -> None:
        self._done.set()


def _silent(_phase: str) -> None:
    pass


class _Steps:
    """The progress callback of an attach that remembers its last step (for the error of a
    target that exits meanwhile)."""

    def __init__(self, say: Callable[[str], None]) -> None:
        self.say, self.last = say, "starting"

    def __call__(self, phase: str) -> None:
        self.last = phase
        self.say(phase)


def only_mapped_probes(pid: int, *, cpu_hz: int, ops: bool):
    """The probes of a one-shot window: only what the process maps now is compiled in."""
    from stacklens.bpf import ProbeConfig, ProbeSession

    return ProbeSession(pid, ProbeConfig(cpu_sample_hz=cpu_hz, ops=ops, only_mapped=True))


def oneshot_session(pid: int, **kw) -> ProcessSession:
    return ProcessSession(pid, probe_factory=only_mapped_probes, **kw)


def profile_pid(
    pid: int, *, duration_s: float, agent: bool = False, cpu_hz: int = 99, ops: bool = True,
    session_factory=oneshot_session, progress: Callable[[str], None] | None = None,
    procfs=None,
) -> Snapshot:
    """Attach to `pid`, collect for `duration_s` from the end of the attach (or until the target
    exits), drain, detach; the snapshot's meta["window"] accounts for the window (with
    `target_exited` when the target ended it). A PID that cannot be profiled is refused with the
    reason before any work (`core.check_target`)."""
    check_target(pid, procfs)
    born = process_start(pid, procfs)
    steps = _Steps(progress or _silent)
    s = session_factory(pid, agent=agent, cpu_hz=cpu_hz, ops=ops)
    try:
        steps(f"attaching to {pid}")
        try:
            s.start(window=True, progress=steps)
        except (StacklensError, OSError) as e:
            if born is not None and process_start(pid, procfs) != born:
                raise NoSuchProcess(f"process {pid} exited while stacklens was attaching to it (at step "
                                    f"'{steps.last}'); nothing was left attached and nothing was measured") from e
            raise
        steps.say(f"collecting for {duration_s:g}s")
        if isinstance(progress, Progress):
            progress.quiet()
        exited = s.wait_window(max(0.0, duration_s - (time.monotonic_ns() - s.window.start_ns) / 1e9))
        s.close_window(progress=steps.say)
        snap = s.snapshot()
        if exited and isinstance(snap.meta.get("window"), dict):
            snap.meta["window"]["target_exited"] = True
        return snap
    finally:
        s.stop()


def profile_through_daemon(
    client, pid: int, *, duration_s: float, agent: bool = False, cpu_hz: int = 99, ops: bool = True,
    progress: Callable[[str], None] | None = None, procfs=None,
) -> Snapshot:
    """`profile_pid` through a running stacklensd: a window on its session (daemon/windows.py),
    held by this call. Its BPF program is compiled already, so collecting starts within the
    attach (~1 s) instead of after a compile (4-10 s); GPU records are flushed at both edges; the
    window ends at its deadline or the target's exit, and ending this process ends it too. The
    snapshot's meta["window"] is the same account as a one-shot window's (lateness unknown)."""
    check_target(pid, procfs)
    say = progress or _silent

    def phase(p: str) -> None:
        say(p)
        if p.startswith("collecting") and isinstance(progress, Progress):
            progress.quiet()

    say(f"profiling {pid} through stacklensd (its compiled program)")
    return client.profile(pid, duration_s=duration_s, agent=agent, cpu_hz=cpu_hz, no_ops=not ops, on_phase=phase)


def record_command(cmd: list[str], *, agent: bool = False, cpu_hz: int = 99,
                   progress: Callable[[str], None] | None = None,
                   session_factory=ProcessSession, program_stdout=None) -> tuple[Snapshot, int]:
    """Start `cmd` held before its first instruction (its first Python code, for Python),
    attach, let it run until it exits, drain. Returns (snapshot, the command's exit status).
    `program_stdout`: where the program's standard output goes (None: ours; the CLI gives
    stderr when the profile goes to stdout, so the two never mix)."""
    from stacklens.cli.held import HeldCommand

    say = progress or _silent
    say(f"starting {cmd[0]} (held until the probes are attached)")
    held = HeldCommand(cmd) if program_stdout is None else HeldCommand(cmd, stdout=program_stdout)
    try:
        say(f"{held.pid} held at its {held.where}; attaching")
        s = session_factory(held.pid, agent=agent, cpu_hz=cpu_hz)
        s.notes.extend(held.notes)
        try:
            s.start(window=True, progress=say, before_agent=held.release)
            say(f"running {held.pid} until it exits")
            if isinstance(progress, Progress):
                progress.quiet()
            status, cpu_ns = held.wait()
            # rusage: the CPU time of the whole run, including the held start-up before the window
            # (the first Python call), which /proc no longer shows once the child is reaped
            s.close_window(cpu_end_ns=cpu_ns or None, progress=say)
            return s.snapshot(), status
        finally:
            s.stop()
    finally:
        held.kill()


def assess(snap: Snapshot) -> tuple[list[str], IncompleteProfile | None]:
    """The window's account as lines for stderr, and an error when the window measured nothing
    (no sample or event at all, and the target exited during it or its CPU time is unknown), or
    when the target ran on CPU but the profile holds no samples, or far fewer than were due."""
    meta = snap.meta or {}
    w = meta.get("window") or {}
    lines = [f"note: {n}" for n in meta.get("notes", [])]
    if not w:
        return lines, None
    got, cpu_s, hz = w.get("cpu_samples", 0), w.get("target_cpu_s"), w.get("cpu_hz", 0)
    lines.append(window_line(w))
    exited = f"the process exited {w.get('seconds', 0):.1f}s into the window" if w.get("target_exited") else ""
    if not _measured(snap) and exited:
        return lines, IncompleteProfile(f"nothing was measured: {exited}, before any sample or event arrived; "
                                        "nothing was written")
    if not _measured(snap) and cpu_s is None:
        return lines, IncompleteProfile(
            f"nothing was measured: no sample or event arrived ({_why(w)}) and the target's CPU time could not "
            "be read (/proc/PID/stat); nothing was written — run `stacklens doctor --pid PID`")
    if exited:
        lines.append(f"note: {exited}; the profile covers it up to its exit")
    if w.get("ended_early"):
        lines.append(f"note: the window was ended by its client (Ctrl-C) after {w.get('seconds', 0):.1f}s; "
                     "the profile covers it up to then")
    if cpu_s is None:
        lines.append("note: the target's CPU time could not be read "
                     + ("after its exit" if exited else "(/proc/PID/stat)") + "; samples not checked")
        return lines, None
    if cpu_s < NO_CPU_S and got == 0:
        lines.append(f"note: the process used {cpu_s:.2f}s of CPU in the {w['seconds']:.1f}s window "
                     "(it was sleeping or blocked): nothing ran on CPU to sample")
        return lines, None
    want = cpu_s * hz
    if got == 0 and want >= 3:
        return lines, IncompleteProfile(
            f"the process ran {cpu_s:.2f}s on CPU in the {w['seconds']:.1f}s window but no CPU sample "
            f"arrived ({_why(w)}); nothing was written — run `stacklens doctor --pid PID`")
    if want >= MIN_EXPECTED and got < want - max(SHORTFALL * want, CHANCE_SD * math.sqrt(want)):
        return lines, IncompleteProfile(
            f"incomplete profile: {got} CPU samples where about {want:.0f} were due ({hz} Hz × "
            f"{cpu_s:.2f}s of CPU); {_why(w)}. The profile written has only what arrived")
    return lines, None


def _measured(snap: Snapshot) -> bool:
    """Whether the profile holds anything at all (a sample or an event of any measured metric)."""
    return any(snap.total(m) for m in snap.metrics if m not in snap.unavailable)


def _why(w: dict) -> str:
    why = []
    if w.get("events_dropped"):
        why.append(f"{w['events_dropped']} events dropped by BPF (ring full)")
    if not w.get("drained", True):
        why.append(f"the drain stopped after {w.get('drain_s', 0):.0f}s before reading up to the end")
    if w.get("after_window") and not w.get("cpu_samples"):
        why.append(f"{w['after_window']} events arrived stamped after the window")
    if why:
        return "; ".join(why)
    if w.get("cpu_samples"):
        return "BPF delivered fewer samples than were due (was the machine overloaded? `stacklens doctor`)"
    return "BPF delivered no sample for this process (is the cpu-clock perf event allowed? `stacklens doctor`)"
