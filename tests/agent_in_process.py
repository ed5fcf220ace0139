"""The agent bootstrap run in this process against a real `AgentServer` (SO_PEERCRED pid = ours),
as the pending call would run it (its text exec'd in a fresh namespace): how
tests/unit/test_agent_bootstrap.py and benchmarks/probe_agent_residue.py attach and detach.

No privilege, no ptrace; an attach and a detach take a few tens of ms.
"""

from __future__ import annotations

import threading
import time

from stacklens.inject.bootstrap import THREAD_NAME, bootstrap_body
from stacklens.inject.channel.server import AgentServer

TIMEOUT_S = 30.0


def wait(cond, timeout: float = TIMEOUT_S) -> bool:
    """Whether `cond()` came true within `timeout` seconds (asked every 10 ms)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.01)
    return False


def agent_threads() -> list[threading.Thread]:
    """The agent's threads in this process, running or past their rename at detach."""
    return [t for t in threading.enumerate() if t.name in (THREAD_NAME, THREAD_NAME + "-exiting")]


def attach(srv: AgentServer, nonce: str = "0") -> None:
    """Runs the bootstrap for `srv` here; returns once the agent said hello."""
    exec(bootstrap_body(srv.target_path, srv.target_agent_dir, srv.token, nonce), {})
    assert srv.wait_hello(TIMEOUT_S), "no hello from the agent"


def detach(srv: AgentServer) -> None:
    """Asks the agent to stop; returns once its thread has ended."""
    assert srv.stop_agent(TIMEOUT_S), "the agent did not stop"
    assert wait(lambda: not agent_threads()), "the agent thread did not end"
