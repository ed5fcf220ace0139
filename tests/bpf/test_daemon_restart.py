"""stacklensd killed with SIGKILL while serving agents, then restarted (issue 26, acceptance 2 and 5).

Real parts: the daemon and the CLI as installed, 8 idle Python targets, `attach --agent` (BPF
probes and the injected agent), the host's agent directory (/run/stacklens/agents, shared with
any other daemon on the machine: only our targets' files are looked at). Needs root and BPF.
After kill -9 each target's lock, socket and code (with its bootstrap token) stay; the restarted
daemon removes them before it says ready, writes a new token, and 8 concurrent re-attaches all
succeed (none refused as "already serves"). One kill -9 round here, to keep the tier short; the
20 batches of 8 and 5 rounds are benchmarks/concurrent_attaches.sh (docs/benchmarks/attach.md).
"""

from __future__ import annotations

import os

import pytest

from stacklens.inject.channel.agentdir import HOST_AGENT_DIR
from tests.bpf.test_daemon_robust import Stacklensd, cli_all

TARGETS = 8


def _agent_files(pids: list[int]) -> list[str]:
    names = os.listdir(HOST_AGENT_DIR) if HOST_AGENT_DIR.is_dir() else []
    return sorted(n for n in names for p in pids if n.startswith((f"agent-{p}.", f"agent-{p}-")))


def _attach_all(d: Stacklensd, pids: list[int]) -> None:
    res = cli_all(d.sock, *[("attach", "--agent", str(p)) for p in pids])
    assert [r.returncode for r in res] == [0] * len(pids), [r.stderr for r in res if r.returncode]
    assert not any("already serves" in r.stderr for r in res)


def _kill9(d: Stacklensd) -> None:
    d.proc.kill()
    d.proc.wait()          # reaped: the kernel has closed its descriptors and dropped its flocks
    d._log.close()
    d.proc.stdout.close()


@pytest.mark.timeout(900)   # 2 batches of 8 agent attaches, each after a fresh BCC compile
def test_kill9_and_restart_leave_no_agent_file_and_concurrent_reattaches_succeed(tmp_path, bpf_available,
                                                                                 start_target):
    pids = [start_target("idle_loop.py").pid for _ in range(TARGETS)]
    d = Stacklensd(tmp_path / "d")
    try:
        _attach_all(d, pids)
        served = _agent_files(pids)
        assert len(served) == 3 * TARGETS, served           # lock, socket, code of each
        token = (d.sock.parent / "token").read_text()
        _kill9(d)
        assert _agent_files(pids) == served                 # what a killed daemon leaves behind
        d = Stacklensd(tmp_path / "d")                      # same socket: returns once it says ready
        assert _agent_files(pids) == []
        assert (d.sock.parent / "token").read_text() != token
        assert "removed the agent files of" in d.log()
        _attach_all(d, pids)
        assert len(_agent_files(pids)) == 3 * TARGETS
        res = cli_all(d.sock, *[("detach", str(p)) for p in pids])
        assert [r.returncode for r in res] == [0] * TARGETS, [r.stderr for r in res if r.returncode]
        assert _agent_files(pids) == []
    finally:
        if d.alive():
            d.stop()
