"""One profiling session per attached PID: probes (+ optional agent) → one aggregation thread → CCT.

Requires root (BPF, ptrace for the agent). The aggregation thread is the only writer of the tree;
other threads get snapshots by asking it (a future served between batches), so the tree needs no
locks. Target exit is noticed within one poll interval and closes the session.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import time
from typing import Any, Callable, Protocol

from stacklens.cct import Snapshot
from stacklens.daemon.edges import HeldEdges
from stacklens.daemon.join.joiner import Joiner
from stacklens.daemon.desk import RequestDesk
from stacklens.daemon.inflight import read_in_flight
from stacklens.daemon.oneshotwindow import DRAIN_GRACE_NS, OneShot, Window
from stacklens.introspect.ranks import RankProc, read_rank
from stacklens.errors import NoSuchProcess, StacklensError
from stacklens.inject.channel.gpu import VENDORS, Vendor, pick_join, vendor_for
from stacklens.records.agent import JoinKind
from stacklens.introspect.procfs import ProcFS, pid_alive
from stacklens.textsafe import safe_text

log = logging.getLogger(__name__)

POLL_MS = 50
# At most this many events and agent records per loop turn, so snapshot requests are answered
# while a fast job outruns the aggregation (measured on the H200: a ViT job at ~25k launches/s
# plus as many kernel records kept the loop busy past the 10 s request timeout). What waits stays
# in bounded queues: the BPF ring (drops counted by the probes) and the agent server's deque.
BATCH_EVENTS = 20_000
DRAIN_TIMEOUT_S = 300.0
# A program released by `record` imports its first modules within this long; their module-body
# code objects live for milliseconds, so the ring is read every 1 ms then (not every POLL_MS)
# to name them before they are freed.
FAST_START_S = 2.0   # the drain waits on events, this only bounds a stuck one (then: not drained)
# A window's edge through a held session (`edge`) waits at most this long for the BPF ring and
# the agent's flush; what it could not wait for is said (the edge is then not drained).
EDGE_TIMEOUT_S = 10.0
# A held session asks its agent for every GPU record this often (the agent's forced CUPTI flush;
# CUPTI itself hands over a buffer only once it is full and complete, seconds to minutes on a busy
# GPU): the live tree's GPU time lags its CPU samples by at most this, plus the transport.
HELD_FLUSH_S = 2.0


def process_facts(pid: int) -> tuple[str, RankProc | None, dict[str, Any]]:
    """What an attach reads once about the process: its name (the target's choice: escaped,
    textsafe.py), its torch.distributed rank if any (introspect/ranks.py), and the profile meta of
    the rank and the working directory (`line` labels are relative to it, daemon/prom.py)."""
    comm = ""
    try:
        comm = safe_text(ProcFS().comm(pid))
    except (StacklensError, OSError):
        pass
    meta: dict[str, Any] = {}
    rank = read_rank(pid)
    if rank is not None:
        meta["rank"] = rank.to_json()
    cwd = process_cwd(pid)
    if cwd is not None:
        meta["cwd"] = cwd
    return comm, rank, meta


class EventSource(Protocol):
    def attach(self) -> Any: ...
    def poll(self, timeout_ms: int = 100, max_events: int = ...) -> list[Any]: ...
    def stats(self) -> dict[str, int]: ...
    def detach(self) -> None: ...
    # optional: in_flight() -> list[Event], the return-probed calls not yet returned (ProbeSession)
    # optional: read_notes() -> list[str], what was read from the target and could not be used
    # (bad code objects, line tables, strings: counted, frames marked), for the profile's notes


class AgentSource(Protocol):
    def poll(self, max_n: int | None = None) -> list[Any]: ...
    def stop(self) -> bool: ...
    def close(self) -> None: ...


def process_start(pid: int, procfs: ProcFS | None = None) -> int | None:
    """The process's start time (clock ticks after boot): with the PID, it names one process
    (a PID is reused, a start time with it is not); None once it is gone."""
    try:
        return (procfs or ProcFS()).starttime(pid)
    except (StacklensError, OSError, ValueError, IndexError):
        return None


def process_cwd(pid: int, procfs: ProcFS | None = None) -> str | None:
    """The process's working directory as its own paths name it (/proc/PID/cwd; under a chroot in
    the daemon's mount namespace, less /proc/PID/root's prefix), escaped; None when it cannot be
    read (no privilege, gone, deleted)."""
    base = (procfs or ProcFS()).root / str(pid)
    try:
        cwd, root = os.readlink(base / "cwd"), os.readlink(base / "root").rstrip("/")
    except OSError:
        return None
    if not cwd.startswith("/") or cwd.endswith(" (deleted)"):
        return None
    if root and (cwd == root or cwd.startswith(root + "/")):
        cwd = cwd[len(root):] or "/"
    return safe_text(cwd)


def process_cpu_ns(pid: int, procfs: ProcFS | None = None) -> int | None:
    """utime + stime of the whole process (every thread, live or exited) in ns, or None."""
    try:
        return (procfs or ProcFS()).cpu_time_ns(pid)
    except (StacklensError, OSError, IndexError):
        return None


def default_probe_factory(pid: int, *, cpu_hz: int, ops: bool) -> EventSource:
    from stacklens.bpf import ProbeConfig, ProbeSession

    return ProbeSession(pid, ProbeConfig(cpu_sample_hz=cpu_hz, ops=ops))


def default_probe_prepare(pid: int) -> bool:
    """Compiles ahead the BPF program an attach with the daemon's defaults would use for `pid`
    (bpf/shared.py keeps it); attaches nothing. True when it compiled one."""
    from stacklens.bpf import ProbeConfig, ProbeSession

    return ProbeSession(pid, ProbeConfig()).prepare()


# The agent's wall-clock Python sampler: each sample takes the GIL from the target's threads. On
# the H200 machine a GIL hand-off to another thread waits for that vCPU to wake, and a ViT loop
# lost 1.5x to the sampler at 100 Hz (with a poll(0) spin, since fixed; docs/benchmarks/gpu.md run
# 14). On-CPU Python stacks come from BPF at cpu_hz without the GIL; the agent adds off-CPU and
# all-thread samples, for which 20 Hz is enough. ProcessSession(agent_config={"sample_hz": ...}).
# When BPF has no Python stacks (unsupported CPython, no CPU sampling) the session asks for no
# rate (sample_hz None): the agent samples at its own default (inject/agent DEFAULTS).
AGENT_SAMPLE_HZ = 20


def default_agent_factory(pid: int, *, sample_hz: float | None, gpu_api_records: bool = False,
                          config: dict | None = None) -> AgentSource:
    """``sample_hz`` None: the agent's default rate (AgentLink sends none)."""
    from stacklens.daemon.agentlink import AgentLink

    return AgentLink(pid, sample_hz=sample_hz, gpu_api_records=gpu_api_records, config=config)


def _env_api_records() -> bool:
    """Default (STACKLENS_GPU_API_RECORDS unset or 0): the agent collects no CUPTI API records and
    kernels join to launches by order (daemon/join/orderjoin.py). 1: CUPTI API records too, and the exact
    join through them — costlier while attached, and API tracing leaves a cost in the process after
    detach (measured on the H200, docs/benchmarks/gpu.md)."""
    return os.environ.get("STACKLENS_GPU_API_RECORDS", "0").strip() in ("1", "true", "yes", "on")


def thread_name(procfs: ProcFS, pid: int, tid: int) -> str:
    """The thread's name (its comm, `ProcFS.thread_comm`), escaped (the target chose it); ""
    once the thread is gone.
    The agent's tids are those of the target's PID namespace: in a container they may name
    another thread or none."""
    try:
        return safe_text(procfs.thread_comm(pid, tid))
    except (OSError, StacklensError):   # gone (NoSuchProcess), or not ours to read
        return ""


def detect_gpu_vendor(pid: int, procfs: ProcFS | None = None) -> Vendor | None:
    """The GPU vendor whose collector the agent will pick in the target (by the libraries it has
    mapped now: the agent's own rule), or None. One read of /proc/PID/maps."""
    try:
        maps = (procfs or ProcFS()).maps(pid)
    except (StacklensError, OSError):
        return None
    return vendor_for(m.path for m in maps if m.path.startswith("/"))


class ProcessSession:
    def __init__(
        self,
        pid: int,
        *,
        agent: bool = False,
        cpu_hz: int = 99,
        ops: bool = True,
        max_nodes: int = 100_000,
        probe_factory: Callable[..., EventSource] = default_probe_factory,
        agent_factory: Callable[..., AgentSource] = default_agent_factory,
        on_close: Callable[["ProcessSession"], None] | None = None,
        gpu_api_records: bool | None = None,
        agent_config: dict | None = None,
        gpu_vendor: str | None = None,
    ) -> None:
        """``gpu_api_records``: ask for the API-record join (None: STACKLENS_GPU_API_RECORDS).
        ``gpu_vendor``: a name of ``inject/channel/gpu.VENDORS`` (None: detected from the target's mapped
        libraries); the join is the one its declaration allows (``inject/channel/gpu.pick_join``)."""
        if not pid_alive(pid):
            raise NoSuchProcess(f"no process {pid}: check the PID with `stacklens ps` or `ps -p {pid}`")
        self.pid = pid
        self.proc_start = process_start(pid)
        self.want_agent = agent
        self.cpu_hz = cpu_hz
        self.ops = ops
        self._probe_factory = probe_factory
        self._agent_factory = agent_factory
        self._on_close = on_close
        self.gpu_api_records = _env_api_records() if gpu_api_records is None else gpu_api_records
        self.agent_config = dict(agent_config or {})   # more agent settings (benchmarks' variants)
        self._bpf_python = False        # the probes read Python stacks on CPU samples (attach report)
        self.gpu_vendor = VENDORS[gpu_vendor] if gpu_vendor is not None else detect_gpu_vendor(pid)
        self.join_kind = pick_join(self.gpu_vendor, self.gpu_api_records)
        self.joiner = Joiner(pid, agent=agent, max_nodes=max_nodes, join=self.join_kind,
                             thread_name=functools.partial(thread_name, ProcFS(), pid))
        self.probes: EventSource | None = None
        self.agent: AgentSource | None = None
        self.notes: list[str] = []
        self.state = "starting"
        self.started = time.time()
        self.desk = RequestDesk(pid)     # what readers ask the aggregation thread (daemon/desk.py)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._stats: dict[str, int] = {}
        self.comm = ""
        self.rank: RankProc | None = None
        self.window: Window | None = None
        self.oneshot: OneShot | None = None   # the window's close (daemon/oneshotwindow.py)
        self.read_up_to_ns = 0   # the BPF ring was found empty at this time (every event before it joined)
        self._fast_start = False   # a program let go at its start: read the ring every 1 ms at first
        self._read_notes: list[str] = []   # the probes' read_notes(), kept past their detach
        self.edges = HeldEdges(self)   # windows' edges waiting for the aggregation thread (daemon/edges.py)
        self._collecting_since: float | None = None   # time.monotonic() at the end of the attach
        self._ended_at: float | None = None           # ... and when the session ended

    # ---- lifecycle ------------------------------------------------------------------------
    def start(self, *, window: bool = False, progress: Callable[[str], None] | None = None,
              before_agent: Callable[[], None] | None = None) -> list[str]:
        """Attach. `window`: the session covers [end of the probes' attach, close_window()]
        (one-shot profiles): events stamped outside are counted, not joined. `progress(phase)`
        hears the attach phases. `before_agent`: called once the probes are attached, before
        the agent is injected (`record` lets its held program go there; the probes read the
        process's symbol tables first, so its first samples decode at once)."""
        self.comm, self.rank, facts = process_facts(self.pid)
        self.joiner.meta.update({"pid": self.pid, "comm": self.comm, "cpu_hz": self.cpu_hz,
                                 "start_unix_ns": time.time_ns(), **facts})
        self.probes = self._probe_factory(self.pid, cpu_hz=self.cpu_hz, ops=self.ops)
        if progress is not None and hasattr(self.probes, "on_phase"):
            self.probes.on_phase = progress
        try:
            report = self.probes.attach()
            if before_agent is not None and hasattr(self.probes, "preload_symbols"):
                if progress is not None:
                    progress("reading symbols")
                self.probes.preload_symbols()
            if window:
                self.window = Window(time.monotonic_ns(), process_cpu_ns(self.pid))
                self.oneshot = OneShot(self, self.window, process_cpu_ns, BATCH_EVENTS)
            if before_agent is not None:
                self._fast_start = True
                before_agent()
            self.notes.extend(getattr(report, "notes", []) or [])
            self._bpf_python = bool(getattr(report, "python_stacks", False)) and \
                getattr(report, "cpu_sampling_hz", self.cpu_hz) > 0
            if self.want_agent:
                # the agent sends API records exactly when the session's join reads them
                kw = {"gpu_api_records": True} if self.join_kind is JoinKind.API_RECORDS else {}
                if self.agent_config:
                    kw["config"] = self.agent_config
                hz = self.agent_config.get("sample_hz", self._default_sample_hz())
                if progress is not None:
                    progress("injecting the agent")
                self.agent = self._agent_factory(self.pid, sample_hz=hz, **kw)
                self.notes.append("agent: injected (Python sampler; GPU collector if CUDA/ROCm is present; GPU "
                                  f"records flushed every {HELD_FLUSH_S:g} s, at a window's edges too)")
        except BaseException:
            self._teardown()
            raise
        self.joiner.meta["notes"] = list(self.notes)
        self.state = "attached"
        self._collecting_since = time.monotonic()
        self._thread = threading.Thread(target=self._run, name=f"stacklens-agg-{self.pid}", daemon=True)
        self.desk.opened()
        self._thread.start()
        return self.notes

    def _default_sample_hz(self) -> float | None:
        """AGENT_SAMPLE_HZ when BPF samples on-CPU Python stacks (the attach report says so),
        else the agent's sampler is the only Python view: None, the agent's default rate."""
        return AGENT_SAMPLE_HZ if self._bpf_python else None

    def stop(self, state: str = "detached") -> None:
        self._stop.set()
        if self._thread and self._thread is not threading.current_thread():
            self._thread.join(timeout=10)
        if self.state in ("attached", "starting"):
            self.state = state
        self._final_drain()
        self._teardown()

    def _final_drain(self) -> None:
        """What is still in flight at detach goes into the tree: the agent's forced flush (GPU
        records of the last launches) and the probes' last events."""
        if self._thread is not None and self._thread.is_alive():
            return  # the aggregation thread did not stop: it still owns the tree
        if self.window is not None and self.window.closed:
            return  # closed and drained up to its end; what came after is not part of it
        try:
            self.drain_agent()
            if self.probes is not None:
                for ev in self.probes.poll(0):
                    self.joiner.on_bpf(ev)
            self.joiner.finish()
        except Exception as e:  # noqa: BLE001 — detach goes on
            self.notes.append(f"final drain: {e}")

    def drain_agent(self) -> None:
        """The agent stops (its forced flush: GPU records of the last launches) and what it sent
        last is joined; a stopped process (SIGSTOP, a debugger) is said in the notes."""
        if self.agent is None:
            return
        if getattr(self.agent, "target_stopped", lambda: False)():
            self.notes.append("detach: the process is stopped (SIGSTOP or a debugger); its "
                              "agent ends its own detach when the process runs again")
        self.agent.stop()
        for rec in self.agent.poll():
            self.joiner.on_agent(rec)

    def _teardown(self) -> None:
        if self.agent is not None:
            try:
                self.agent.close()
            except Exception as e:  # noqa: BLE001 — detach must go on whatever the agent did
                self.notes.append(f"agent close: {e}")
            self.agent = None
        if self.probes is not None:
            try:
                self._stats = dict(self.probes.stats())
            except Exception:  # noqa: BLE001
                pass
            self.refresh_read_notes()
            self.probes.detach()
            self.probes = None

    def refresh_read_notes(self) -> None:
        """The probes' notes on bad reads into the profile's notes (replacing the last ones):
        on the aggregation thread, or once it has ended."""
        read_notes = getattr(self.probes, "read_notes", None)
        if read_notes is None:
            return
        try:
            fresh = list(read_notes())
        except Exception:  # noqa: BLE001 — notes are an account, never a reason to fail a request
            log.exception("read notes of session %d", self.pid)
            return
        if fresh == self._read_notes:
            return
        # a new list: snapshots taken before share the old one (Joiner.snapshot copies meta shallowly)
        kept = [n for n in self.joiner.meta.get("notes", []) if n not in self._read_notes]
        self.joiner.meta["notes"] = kept + fresh
        self._read_notes = fresh

    # ---- the aggregation thread -----------------------------------------------------------
    def _run(self) -> None:
        last_alive = 0.0
        last_flush = time.monotonic()
        try:
            w = self.window
            fast_until = time.monotonic() + FAST_START_S if self._fast_start else 0.0
            while not self._stop.is_set():
                polled_at = time.monotonic_ns()
                evs = self.probes.poll(1 if fast_until and time.monotonic() < fast_until else POLL_MS,
                                       max_events=BATCH_EVENTS)
                ring_empty = not evs
                # every event BPF stamped before this is read (the window's rule, past_end): the ring
                # found empty at polled_at, or an event read that is stamped DRAIN_GRACE_NS later
                # (a busy GPU process never leaves the ring empty)
                if ring_empty:
                    self.read_up_to_ns = polled_at
                else:
                    self.read_up_to_ns = max(self.read_up_to_ns, max(ev.ktime_ns for ev in evs) - DRAIN_GRACE_NS)
                if w is not None:
                    evs = w.admit(evs)
                for ev in self.edges.gate.bpf(evs):
                    self.joiner.on_bpf(ev)
                if self.agent is not None:
                    self.edges.join_agent(self.edges.gate.agent(self.agent.poll(BATCH_EVENTS)))
                self.edges.take_due()
                self.desk.serve()
                if w is not None and (w.past_end(ring_empty, time.monotonic_ns()) or self.oneshot.abort):
                    self.oneshot.close_now()
                    self.state = "closed"
                    break
                now = time.monotonic()
                if now - last_flush >= HELD_FLUSH_S and self.agent is not None:
                    last_flush = now
                    ask = getattr(self.agent, "request_flush", None)
                    if ask is not None:
                        ask()
                if now - last_alive > 0.2:
                    last_alive = now
                    self.joiner.expire(time.monotonic_ns())
                    if not self._same_process():
                        # drain what is left, then close
                        if w is not None:
                            self.oneshot.drain_exited()
                            self.oneshot.close_now()
                        else:
                            for ev in self.probes.poll(0):
                                self.joiner.on_bpf(ev)
                        self.state = "exited"
                        break
        except Exception as e:  # noqa: BLE001 — a session error must not take the daemon down
            # the whole reason, for `ps` (it shows the state in full) and the log (with the traceback)
            self.state = f"error: {type(e).__name__}: {e}"
            log.error("session %d (%s) ended: %s", self.pid, self.comm or "?", self.state, exc_info=e)
        finally:
            self._ended_at = time.monotonic()
            self.edges.end()
            self.desk.serve()
            if self.state != "attached":
                self._teardown()
                self.desk.serve()
                if self._on_close:
                    self._on_close(self)
            self.desk.close()
            # those queued before: none waits for a thread that has ended (a window that saw the
            # session end while it was torn down asked for its end edge meanwhile)
            self.edges.end()
            self.desk.serve()

    def _same_process(self) -> bool:
        """The process is alive and is the one attached: a PID reused between two polls names
        another start time."""
        if not pid_alive(self.pid):
            return False
        return self.proc_start is None or process_start(self.pid) in (self.proc_start, None)

    # ---- a window's edge on a held session (daemon/edges.py) -----------------------------------
    def edge(self, timeout_s: float = EDGE_TIMEOUT_S, t_ns: int | None = None) -> tuple[Snapshot, list[str]]:
        """The tree at a window's edge (now), exactly: the aggregation thread takes it once the
        BPF ring has been read past now and the agent's answer to a flush asked now is joined,
        holding back what came after. Waits at most `timeout_s` for that, then takes it as it
        is; returns the snapshot and what it could not wait for (empty: exact). `t_ns`: the
        edge's time (CLOCK_MONOTONIC, not later than now), else now."""
        return self.edges.ask(timeout_s, time.monotonic_ns() if t_ns is None else t_ns)

    # ---- a window with an end (daemon/oneshotwindow.py OneShot) ------------------------------
    def close_window(self, *, cpu_end_ns: int | None = None,
                     timeout_s: float = DRAIN_TIMEOUT_S,
                     progress: Callable[[str], None] | None = None) -> dict:
        """End the window now, wait until every event stamped up to its end has
        been read and joined (the BPF ring, then the agent's forced flush), and return its
        account (also in the snapshot's meta["window"]). `cpu_end_ns`: the target's CPU time
        at the end when the caller knows it better (a reaped child's rusage)."""
        if self.oneshot is None:
            raise StacklensError("close_window() needs a session started with window=True")
        return self.oneshot.close(cpu_end_ns=cpu_end_ns, timeout_s=timeout_s, progress=progress)

    def wait_window(self, timeout_s: float) -> bool:
        """Wait up to `timeout_s` for the window to close by itself (the target exited)."""
        return self.oneshot.done.wait(timeout_s)

    # ---- reading --------------------------------------------------------------------------
    def in_flight(self) -> dict[str, list[dict]]:
        """The GPU side of the target now, as the probes saw it (daemon/inflight.py)."""
        return self.desk.call(lambda: read_in_flight(self.probes, self.joiner))

    def aggregating(self) -> bool:
        """Whether the aggregation thread runs (while it does, it alone touches the tree)."""
        return self._thread is not None and self._thread.is_alive()

    def wait_aggregation(self, timeout_s: float) -> bool:
        """Waits up to `timeout_s` for the aggregation thread to end; True once it has."""
        if self._thread is not None:
            self._thread.join(timeout=timeout_s)
        return not self.aggregating()

    def snapshot(self, window_s: float | None = None) -> Snapshot:
        """The tree: cumulative since the attach (its meta's window_s: the seconds it covers, what
        advice and rates divide by), or the last `window_s` seconds."""
        def take() -> Snapshot:
            self.refresh_read_notes()
            snap = self.joiner.snapshot(window_s=window_s)
            if window_s is None and self.window is None and self._collecting_since is not None:
                end = self._ended_at if self._ended_at is not None else time.monotonic()
                snap.meta["window_s"] = round(max(0.0, end - self._collecting_since), 6)
            return snap

        return self.desk.call(take)

    def stats(self) -> dict[str, int]:
        def collect() -> dict[str, int]:
            out = dict(self.joiner.stats.as_dict())
            if self.probes is not None:
                try:
                    self._stats = dict(self.probes.stats())
                except Exception:  # noqa: BLE001
                    pass
            out.update({f"bpf_{k}": int(v) for k, v in self._stats.items() if isinstance(v, (int, float))})
            out["read_up_to_ns"] = self.read_up_to_ns   # CLOCK_MONOTONIC: a client's window drains to it
            agent_stats = getattr(self.agent, "stats", None)
            if agent_stats is not None:   # the agent channel: frames, rejections, records dropped
                try:
                    out.update({f"agent_channel_{k}": int(v) for k, v in agent_stats().items()
                                if isinstance(v, (int, float))})
                except Exception:  # noqa: BLE001
                    pass
            return out

        return self.desk.call(collect)
