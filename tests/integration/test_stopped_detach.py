"""A stopped process (SIGSTOP) is detached without waiting for its agent (issue 26: it took
10-15 s); the agent ends its own detach once the process runs again, and the process goes on."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from stacklens.daemon.agentlink import AgentLink
from tests.integration.test_inject import threads, wait_for  # noqa: F401  (skips without ptrace)

pytestmark = pytest.mark.integration
TARGET = Path(__file__).resolve().parents[1] / "targets" / "idle_loop.py"
NO_WAIT_S = 5.0           # the agent's answer was waited for 10 s


def test_a_stopped_process_is_detached_at_once_and_its_agent_leaves_when_it_runs():
    p = subprocess.Popen([sys.executable, str(TARGET)], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "ready"
        base = threads(p.pid)
        link = AgentLink(p.pid)
        assert link.server.wait_hello(60)
        wait_for(lambda: threads(p.pid) == base + 1, timeout=60, what="the agent thread")
        os.kill(p.pid, signal.SIGSTOP)
        wait_for(link.target_stopped, timeout=30, what="the stop")
        t0 = time.monotonic()
        link.close()
        assert time.monotonic() - t0 < NO_WAIT_S
        os.kill(p.pid, signal.SIGCONT)
        wait_for(lambda: threads(p.pid) == base, timeout=60, what="the agent thread gone after SIGCONT")
        assert p.poll() is None                     # the process goes on
    finally:
        os.kill(p.pid, signal.SIGCONT)
        p.kill()
        p.wait()
