"""One profiling session per attached PID: probes (+ optional agent) → one aggregation thread → CCT.

Requires root (BPF, ptrace for the agent). The aggregation thread is the only writer of the tree;
other threads get snapshots by asking it (a future served between batches), so the tree needs no
locks. Target exit is noticed within one poll interval and closes the session.
"""

from __future__ import annotations

import concurrent.futures
import os
import queue
import threading
import time
from typing import Any, Callable, Protocol

from stacklens.cct import Snapshot
from stacklens.daemon.join import Joiner
from stacklens.errors import NoSuchProcess, StacklensError

POLL_MS = 50
# At most this many events and agent records per loop turn, so snapshot requests are answered
# while a fast job outruns the aggregation (measured on the H200: a ViT job at ~25k launches/s
# plus as many kernel records kept the loop busy past the 10 s request timeout). What waits stays
# in bounded queues: the BPF ring (drops counted by the probes) and the agent server's deque.
BATCH_EVENTS = 20_000


class EventSource(Protocol):
    def attach(self) -> Any: ...
    def poll(self, timeout_ms: int = 100, max_events: int = ...) -> list[Any]: ...
    def stats(self) -> dict[str, int]: ...
    def detach(self) -> None: ...


class AgentSource(Protocol):
    def poll(self, max_n: int | None = None) -> list[Any]: ...
    def stop(self) -> bool: ...
    def close(self) -> None: ...


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie has exited as far as profiling goes
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def default_probe_factory(pid: int, *, cpu_hz: int, ops: bool) -> EventSource:
    from stacklens.bpf import ProbeConfig, ProbeSession

    return ProbeSession(pid, ProbeConfig(cpu_sample_hz=cpu_hz, ops=ops))


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
    kernels join to launches by order (daemon/orderjoin.py). 1: CUPTI API records too, and the exact
    join through them — costlier while attached, and API tracing leaves a cost in the process after
    detach (measured on the H200, docs/benchmarks/gpu.md)."""
    return os.environ.get("STACKLENS_GPU_API_RECORDS", "0").strip() in ("1", "true", "yes", "on")


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
    ) -> None:
        if not pid_alive(pid):
            raise NoSuchProcess(f"no process {pid}: check the PID with `stacklens ps` or `ps -p {pid}`")
        self.pid = pid
        self.want_agent = agent
        self.cpu_hz = cpu_hz
        self.ops = ops
        self._probe_factory = probe_factory
        self._agent_factory = agent_factory
        self._on_close = on_close
        self.gpu_api_records = _env_api_records() if gpu_api_records is None else gpu_api_records
        self.agent_config = dict(agent_config or {})   # more agent settings (benchmarks' variants)
        self._bpf_python = False        # the probes read Python stacks on CPU samples (attach report)
        self.joiner = Joiner(pid, agent=agent, max_nodes=max_nodes, api_records=self.gpu_api_records)
        self.probes: EventSource | None = None
        self.agent: AgentSource | None = None
        self.notes: list[str] = []
        self.state = "starting"
        self.started = time.time()
        self._requests: queue.Queue[tuple[concurrent.futures.Future, Callable[[], Any]]] = queue.Queue()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._stats: dict[str, int] = {}
        self.comm = ""

    # ---- lifecycle ------------------------------------------------------------------------
    def start(self) -> list[str]:
        try:
            with open(f"/proc/{self.pid}/comm") as fh:
                self.comm = fh.read().strip()
        except OSError:
            pass
        self.joiner.meta.update({"pid": self.pid, "comm": self.comm})
        self.probes = self._probe_factory(self.pid, cpu_hz=self.cpu_hz, ops=self.ops)
        try:
            report = self.probes.attach()
            self.notes.extend(getattr(report, "notes", []) or [])
            self._bpf_python = bool(getattr(report, "python_stacks", False)) and \
                getattr(report, "cpu_sampling_hz", self.cpu_hz) > 0
            if self.want_agent:
                kw = {"gpu_api_records": True} if self.gpu_api_records else {}
                if self.agent_config:
                    kw["config"] = self.agent_config
                hz = self.agent_config.get("sample_hz", self._default_sample_hz())
                self.agent = self._agent_factory(self.pid, sample_hz=hz, **kw)
                self.notes.append("agent: injected (Python sampler; GPU collector if CUDA/ROCm is present)")
        except BaseException:
            self._teardown()
            raise
        self.joiner.meta["notes"] = list(self.notes)
        self.state = "attached"
        self._thread = threading.Thread(target=self._run, name=f"stacklens-agg-{self.pid}", daemon=True)
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
        try:
            if self.agent is not None:
                self.agent.stop()
                for rec in self.agent.poll():
                    self.joiner.on_agent(rec)
            if self.probes is not None:
                for ev in self.probes.poll(0):
                    self.joiner.on_bpf(ev)
            self.joiner.finish()
        except Exception as e:  # noqa: BLE001 — detach goes on
            self.notes.append(f"final drain: {e}")

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
            self.probes.detach()
            self.probes = None

    # ---- the aggregation thread -----------------------------------------------------------
    def _run(self) -> None:
        last_alive = 0.0
        try:
            while not self._stop.is_set():
                for ev in self.probes.poll(POLL_MS, max_events=BATCH_EVENTS):
                    self.joiner.on_bpf(ev)
                if self.agent is not None:
                    for rec in self.agent.poll(BATCH_EVENTS):
                        self.joiner.on_agent(rec)
                self._serve_requests()
                now = time.monotonic()
                if now - last_alive > 0.2:
                    last_alive = now
                    self.joiner.expire(time.monotonic_ns())
                    if not pid_alive(self.pid):
                        # drain what is left, then close
                        for ev in self.probes.poll(0):
                            self.joiner.on_bpf(ev)
                        self.state = "exited"
                        break
        except Exception as e:  # noqa: BLE001 — a session error must not take the daemon down
            self.state = f"error: {e}"
        finally:
            self._serve_requests()
            if self.state != "attached":
                self._teardown()
                self._serve_requests()
                if self._on_close:
                    self._on_close(self)

    def _serve_requests(self) -> None:
        while True:
            try:
                fut, fn = self._requests.get_nowait()
            except queue.Empty:
                return
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn())
                except Exception as e:  # noqa: BLE001
                    fut.set_exception(e)

    def _call(self, fn: Callable[[], Any], timeout: float = 10.0) -> Any:
        if self._thread is None or not self._thread.is_alive():
            return fn()  # the thread has finished: the joiner is no longer written to
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._requests.put((fut, fn))
        try:
            return fut.result(timeout=timeout)
        except concurrent.futures.TimeoutError:
            raise StacklensError(f"session {self.pid} did not answer within {timeout}s") from None

    # ---- reading --------------------------------------------------------------------------
    def snapshot(self, window_s: float | None = None) -> Snapshot:
        return self._call(lambda: self.joiner.snapshot(window_s=window_s))

    def stats(self) -> dict[str, int]:
        def collect() -> dict[str, int]:
            out = dict(self.joiner.stats.as_dict())
            if self.probes is not None:
                try:
                    self._stats = dict(self.probes.stats())
                except Exception:  # noqa: BLE001
                    pass
            out.update({f"bpf_{k}": int(v) for k, v in self._stats.items() if isinstance(v, (int, float))})
            agent_stats = getattr(self.agent, "stats", None)
            if agent_stats is not None:   # the agent channel: frames, rejections, records dropped
                try:
                    out.update({f"agent_channel_{k}": int(v) for k, v in agent_stats().items()
                                if isinstance(v, (int, float))})
                except Exception:  # noqa: BLE001
                    pass
            return out

        return self._call(collect)
