"""The daemon's handle on an injected agent: socket server + injection as one AgentSource.

Requires root (ptrace or PEP 768 writes into the target). Closing stops the agent (activities
disabled and flushed, threads stopped) and removes the socket.
"""

from __future__ import annotations

from stacklens.errors import StacklensError


class AgentLink:
    def __init__(self, pid: int, *, sample_hz: float | None = None, timeout_s: float = 5.0,
                 gpu_api_records: bool = False, config: dict | None = None) -> None:
        """``config``: more agent settings (inject/agent DEFAULTS keys, e.g. ``{"gpu": False}``);
        the agent ignores keys it does not know. ``sample_hz`` None: the agent's default rate."""
        from stacklens.inject.channel.server import AgentServer
        from stacklens.inject.injector import inject_agent

        self.pid = pid
        # the explicit arguments win: the session's join is built for them
        explicit = {"gpu_api_records": gpu_api_records}
        if sample_hz is not None:
            explicit["sample_hz"] = sample_hz
        self.server = AgentServer(pid, config={"gpu": True, **(config or {}), **explicit})
        try:
            self.result = inject_agent(pid, socket_path=self.server.path, timeout_s=timeout_s)
        except BaseException:
            self.server.close()
            raise

    def poll(self, max_n: int | None = None) -> list:
        return self.server.poll(max_n)

    def stats(self) -> dict:
        return self.server.stats()

    def request_flush(self) -> int | None:
        """A window's edge (`ProcessSession.edge`): the agent hands over what it has; None when
        no agent is connected."""
        return self.server.request_flush()

    def connected(self) -> bool:
        """The agent's channel is up (hello received, not gone): the Prometheus agent gauge."""
        return self.server.connected

    def stop(self) -> bool:
        """Ask the agent to detach: it disables collection, force-flushes, sends what it has.
        A stopped process (SIGSTOP, a debugger's stop) cannot answer: the request is sent and not
        waited for (a detach took 10 s waiting); the agent ends its detach when the process runs
        again (it reads the request, or sees the socket closed)."""
        try:
            return self.server.stop_agent(timeout_s=0.0 if self.target_stopped() else 10.0)
        except StacklensError:
            return False

    def target_stopped(self) -> bool:
        """The process is stopped (state T or t): its agent thread cannot run now."""
        from stacklens.introspect.procfs import ProcFS
        try:
            return ProcFS().state(self.pid) in ("T", "t")
        except (StacklensError, OSError, IndexError):
            return False

    def close(self) -> None:
        try:
            self.stop()
        finally:
            self.server.close()

