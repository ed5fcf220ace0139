"""Where the TUI's snapshots come from: the `SnapshotSource` and `ProcessSource` protocols.

Production: `DaemonProcesses` / `DaemonSnapshotSource` (gRPC to stacklensd, a Unix socket read of
the daemon's token), `LocalSource` (an in-process `ProcessSession`, for `stacklens demo`) and
`FileSource` (a saved profile, no daemon). Tests use fakes with the same methods.

Every method may block (a gRPC call, decoding a 100,000-node profile): the app only calls them
from worker threads. Failures come back as values (`Fetched.error`), never as exceptions into the
UI, so a daemon that goes away or a target that exits becomes a message on screen.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Mapping, Protocol

from stacklens import errors
from stacklens.tui.model import Advice, Evidence, ProcessRow

from stacklens.cct import diff as cct_diff


@dataclass(frozen=True)
class Fetched:
    """One answer of a source: a snapshot, or why there is none."""

    snapshot: Any | None
    state: str = ""  # "attached", "exited", "file", …
    stats: Mapping[str, int] = field(default_factory=dict)
    error: str = ""  # a message for the user; the UI keeps showing the last good snapshot
    final: bool = False  # nothing new will come: stop polling


class SnapshotSource(Protocol):
    name: str  # what the title bar says ("pid 4242 python", "run.json.gz")
    live: bool  # False: fetch once (a saved file)
    windows: bool  # whether window_s and diff are supported

    def fetch(self, window_s: float | None, diff: bool = False) -> Fetched: ...

    def advice(self, window_s: float | None, snapshot: Any | None) -> list[Advice] | str: ...


class ProcessSource(Protocol):
    def processes(self) -> list[ProcessRow]: ...

    def attach(self, pid: int) -> list[str]: ...

    def detach(self, pid: int) -> None: ...

    def open(self, pid: int) -> SnapshotSource: ...


# ---- advice without a daemon -------------------------------------------------------------


def _labels(path: Any) -> tuple[str, ...]:
    return tuple(p if isinstance(p, str) else p.label() for p in (path or ()))


def _evidence(ev: Any) -> tuple[Evidence, ...]:
    if isinstance(ev, Mapping):
        return tuple(Evidence(str(k), float(v)) for k, v in ev.items())
    out = []
    for e in ev or ():
        out.append(Evidence(str(getattr(e, "metric", "")), float(getattr(e, "value", 0.0)), str(getattr(e, "unit", ""))))
    return tuple(out)


def advice_from_finding(f: Any) -> Advice:
    """A protobuf `Finding` or an analyzer finding object, duck-typed, as the TUI's `Advice`."""
    saving = getattr(f, "estimated_saving_share", None)  # protobuf Finding
    if saving is None:
        saving = getattr(f, "estimated_saving", 0.0)  # stacklens.analyzer.Finding
    saving = float(saving or 0.0)
    return Advice(
        rule=str(getattr(f, "rule", "")),
        severity=str(getattr(f, "severity", "")),
        title=str(getattr(f, "title", "")),
        fix=str(getattr(f, "fix", "")),
        path=_labels(getattr(f, "path", ())),
        evidence=_evidence(getattr(f, "evidence", ())),
        saving_share=0.0 if math.isnan(saving) else saving,
    )


def analyze_locally(snapshot: Any | None) -> list[Advice] | str:
    """Run `stacklens.analyzer` on a snapshot, if this build has it; a message otherwise."""
    if snapshot is None:
        return "no profile yet"
    try:
        import stacklens.analyzer as analyzer
    except ImportError:
        return "advice needs stacklens.analyzer, which this installation lacks"
    for name in ("analyze", "advise", "run_rules", "run_all"):
        fn = getattr(analyzer, name, None)
        if callable(fn):
            break
    else:
        return "the analyzer is not available in this build (stacklens.analyzer has no analyze())"
    try:
        return [advice_from_finding(f) for f in fn(snapshot)]
    except Exception as e:  # noqa: BLE001 - a failing rule must not take the UI down
        return f"the analyzer failed: {type(e).__name__}: {e}"


# ---- a saved profile -----------------------------------------------------------------------


def load_profile(path: str) -> Any:
    """Load a saved profile with `stacklens.cct.export.load`; InputError with what to do otherwise."""
    try:
        from stacklens.cct.export import load
    except ImportError as e:  # pragma: no cover - a build without cct/export
        raise errors.InputError(f"cannot open {path}: this build has no profile reader ({e})") from None
    try:
        return load(path)
    except errors.StacklensError:
        raise
    except FileNotFoundError:
        raise errors.InputError(f"{path}: no such file; pass a profile written by `stacklens report -o`") from None
    except (OSError, ValueError, KeyError) as e:
        raise errors.InputError(f"cannot read {path} as a stacklens profile: {e}") from None


class FileSource:
    live = False
    windows = False
    saved = True     # a saved profile (`top --input`): no windows, pause, refresh or detach keys

    def __init__(self, snapshot: Any, name: str) -> None:
        self._snapshot = snapshot
        self.name = name

    @classmethod
    def open(cls, path: str) -> FileSource:
        import os

        return cls(load_profile(path), os.path.basename(path))

    def fetch(self, window_s: float | None, diff: bool = False) -> Fetched:
        return Fetched(self._snapshot, state="file", final=True)

    def advice(self, window_s: float | None, snapshot: Any | None) -> list[Advice] | str:
        return analyze_locally(snapshot)


# ---- an in-process session (stacklens demo) ------------------------------------------------


class LocalSource:
    """A `ProcessSession` (or anything with `.snapshot(window_s)`, `.state`, `.stats()`)."""

    live = True
    windows = True

    def __init__(self, session: Any, name: str = "") -> None:
        self.session = session
        self.name = name or f"pid {getattr(session, 'pid', '?')}"

    def fetch(self, window_s: float | None, diff: bool = False) -> Fetched:
        s = self.session
        state = str(getattr(s, "state", ""))
        try:
            if diff and window_s:
                recent = s.snapshot(window_s=window_s)
                both = s.snapshot(window_s=2 * window_s)
                snap = cct_diff(recent, cct_diff(both, recent))
            else:
                snap = s.snapshot(window_s=window_s)
            stats = s.stats() if hasattr(s, "stats") else {}
        except errors.StacklensError as e:
            return Fetched(None, state=state, error=str(e))
        except ValueError as e:  # a window longer than the session keeps
            return Fetched(None, state=state, error=f"window not available: {e}")
        if state == "exited":
            return Fetched(snap, state, stats, error=f"process {getattr(s, 'pid', '')} exited; showing its last profile", final=True)
        if state.startswith("error"):
            return Fetched(snap, state, stats, error=f"the session stopped ({state})", final=True)
        return Fetched(snap, state, stats)

    def advice(self, window_s: float | None, snapshot: Any | None) -> list[Advice] | str:
        return analyze_locally(snapshot)


# ---- the daemon ----------------------------------------------------------------------------


def _daemon_error(e: errors.StacklensError, pid: int | None = None) -> str:
    if isinstance(e, errors.DaemonUnavailable):
        return f"lost the daemon: {e}"
    if isinstance(e, errors.NoSuchProcess) and pid is not None:
        return f"process {pid} is not attached or has exited ({e}); press Esc for the process list"
    return str(e)


class DaemonSnapshotSource:
    live = True
    windows = True

    def __init__(self, client: Any, pid: int, name: str = "") -> None:
        self.client = client
        self.pid = pid
        self.name = name or f"pid {pid}"

    def fetch(self, window_s: float | None, diff: bool = False) -> Fetched:
        from stacklens.daemon.client import decode_profile

        try:
            kw: dict[str, Any] = {"window_s": window_s or 0.0}
            if diff and window_s:
                kw["diff_window_s"] = window_s
            r = self.client.snapshot_response(self.pid, **kw)
            snap = decode_profile(r.profile)
        except errors.StacklensError as e:
            return Fetched(None, error=_daemon_error(e, self.pid))
        except Exception as e:  # noqa: BLE001 - a malformed answer must not take the UI down
            return Fetched(None, error=f"bad answer from the daemon: {type(e).__name__}: {e}")
        state = r.state
        if state == "exited":
            return Fetched(snap, state, dict(r.stats), error=f"process {self.pid} exited; showing its last profile", final=True)
        return Fetched(snap, state, dict(r.stats))

    def advice(self, window_s: float | None, snapshot: Any | None) -> list[Advice] | str:
        try:
            return [advice_from_finding(f) for f in self.client.advice(self.pid, window_s=window_s or 0.0)]
        except errors.StacklensError as e:
            return _daemon_error(e, self.pid)


def _rank(p: Any) -> str:
    """"RANK/WORLD_SIZE" of a torch.distributed rank; "" for other processes and older daemons."""
    if not _present(p, "rank", absent=False):
        return ""
    return f"{p.rank}/{p.world_size}" if _present(p, "world_size", absent=False) else str(p.rank)


def _present(message: Any, name: str, *, absent: bool = True) -> bool:
    """Whether an `optional` field of a reply is set; a field without presence counts as set,
    and one this daemon's proto lacks (an older daemon) as `absent`."""
    try:
        return message.HasField(name)
    except ValueError:  # a plain proto3 scalar (no presence), or no such field
        return absent if name not in type(message).DESCRIPTOR.fields_by_name else True


class DaemonProcesses:
    """The process list and attach/detach, through a `DaemonClient`."""

    def __init__(self, client: Any) -> None:
        self.client = client

    @classmethod
    def connect(cls, socket_path: str) -> DaemonProcesses:
        from stacklens.daemon.client import DaemonClient

        return cls(DaemonClient(socket_path))

    def processes(self) -> list[ProcessRow]:
        reply = self.client.processes()
        read_at = time.monotonic()  # with each process's CPU time: CPU% from two listings
        return [
            ProcessRow(
                pid=p.pid,
                comm=p.comm,
                attached=p.attached,
                agent=p.agent,
                state=p.state,
                python=p.python,
                gpu_time_share=p.gpu_time_share if _present(p, "gpu_time_share") else math.nan,  # unset: not measured
                launches_per_s=p.launches_per_s,
                sync_wait_share=p.sync_wait_share,
                unavailable=tuple(p.unavailable),
                cpu_time_ns=p.cpu_time_ns if _present(p, "cpu_time_ns", absent=False) else None,
                read_at=read_at,
                rank=_rank(p),
                probe_overhead=p.probe_overhead if _present(p, "probe_overhead", absent=False) else math.nan,
                overhead_note=p.overhead_note,
            )
            for p in reply
        ]

    def check_known(self, pid: int) -> None:
        """`top PID` for a PID neither running nor known to the daemon fails before the UI."""
        from stacklens.errors import NoSuchProcess
        from stacklens.introspect.procfs import pid_alive

        if not pid_alive(pid) and pid not in {p.pid for p in self.client.processes()}:
            raise NoSuchProcess(f"no process {pid}, and stacklensd holds no profile of it: see `stacklens ps`")

    def attach(self, pid: int) -> list[str]:
        return list(self.client.attach(pid))

    def detach(self, pid: int) -> None:
        self.client.detach(pid)

    def open(self, pid: int) -> DaemonSnapshotSource:
        return DaemonSnapshotSource(self.client, pid)
