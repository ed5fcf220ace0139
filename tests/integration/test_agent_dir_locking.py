"""Agent servers sharing one directory (issue 26): files created and locked in one step, and a
stale sweep that never takes a live server's files.

Real parts: real AgentServers in separate processes (as in several daemons, or one daemon's
concurrent attaches) on one directory; no injection, no BPF. Each worker serves its own PID again
and again and checks, while it serves, that its lock file is the inode it holds and that its
socket and code are there. Before the fix 1 in 3 batches of 8 concurrent `attach --agent` lost
one (a false "already serves", or FileNotFoundError); the full 20 batches through the daemon are
benchmarks/concurrent_attaches.sh (docs/benchmarks/attach.md).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from stacklens.errors import AlreadyAttached
from stacklens.inject.channel.agentdir import clean_stale_files
from stacklens.inject.channel.server import AgentServer

pytestmark = pytest.mark.integration

WORKER = r"""
import os, sys
from stacklens.inject.channel.server import AgentServer
d, rounds = sys.argv[1], int(sys.argv[2])
sys.stdin.readline()                       # the start signal: all workers race from here
problems = []
for i in range(rounds):
    try:
        srv = AgentServer(os.getpid(), d)
    except Exception as e:
        problems.append(f"round {i}: {type(e).__name__}: {e}")
        continue
    try:
        me = f"agent-{os.getpid()}"
        if os.stat(f"{d}/{me}.lock").st_ino != os.fstat(srv._files.lock_fd).st_ino:
            problems.append(f"round {i}: the lock file by name is not the one held")
        for name in (f"{me}.sock", f"{me}-code/__init__.py"):
            if not os.path.exists(f"{d}/{name}"):
                problems.append(f"round {i}: {name} gone while serving")
    except OSError as e:
        problems.append(f"round {i}: {type(e).__name__}: {e}")
    finally:
        srv.close()
print("\n".join(problems) if problems else "ok", flush=True)
"""


def _leave_stale(d: Path, pid: int) -> None:
    """What a daemon killed while serving ``pid`` leaves: an unheld lock, a socket, code."""
    (d / f"agent-{pid}.lock").write_text("")
    (d / f"agent-{pid}.sock").write_text("")
    (d / f"agent-{pid}-code").mkdir()
    (d / f"agent-{pid}-code" / "bootstrap-0123abcd.py").write_text("token")


@pytest.mark.parametrize("workers,rounds", [(8, 25)])
def test_concurrent_servers_in_one_directory_never_take_each_others_files(tmp_path, workers, rounds):
    d = tmp_path / "agents"
    with AgentServer(os.getpid(), d):            # makes the directory as the daemon would
        pass
    procs = [subprocess.Popen([sys.executable, "-c", WORKER, str(d), str(rounds)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(workers)]
    try:
        _leave_stale(d, 1)          # PID 1's files from a killed daemon: someone's sweep takes them
        for p in procs:
            p.stdin.write("go\n")
            p.stdin.flush()
        outs = [p.communicate(timeout=240) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert [out.strip() for out, _ in outs] == ["ok"] * workers, [o for o in outs if o[0].strip() != "ok"]
    assert [p.returncode for p in procs] == [0] * workers
    assert sorted(os.listdir(d)) == []           # every server removed its own files, the sweep PID 1's


def test_a_live_servers_files_survive_a_sweep_and_a_held_pid_is_refused(tmp_path):
    d = tmp_path / "agents"
    with AgentServer(os.getpid(), d) as live:
        _leave_stale(d, 1)
        child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
        try:
            with AgentServer(child.pid, d) as other:
                assert other.stats()["stale_cleaned"] == 1
            assert not any(n.startswith(("agent-1.", "agent-1-")) for n in os.listdir(d))
            assert {f"agent-{os.getpid()}.lock", f"agent-{os.getpid()}.sock",
                    f"agent-{os.getpid()}-code"} <= set(os.listdir(d))
            with pytest.raises(AlreadyAttached, match=f"already serves PID {os.getpid()}"):
                AgentServer(os.getpid(), d)
            # the refused server left the live one's files as they were
            assert os.stat(d / f"agent-{os.getpid()}.lock").st_ino == os.fstat(live._files.lock_fd).st_ino
        finally:
            child.stdin.close()
            child.wait()
    assert os.listdir(d) == []


def test_clean_stale_files_keeps_live_servers_and_creates_nothing(tmp_path, monkeypatch):
    from stacklens.inject.channel import agentdir

    d = tmp_path / "agents"
    monkeypatch.setattr(agentdir, "HOST_AGENT_DIR", d)
    assert clean_stale_files() == 0 and not d.exists()      # no directory: none made
    with AgentServer(os.getpid(), d):
        _leave_stale(d, 1)
        (d / "agent-2.sock").write_text("")                 # a socket whose lock is gone
        assert clean_stale_files() == 2
        assert sorted(os.listdir(d)) == sorted([f"agent-{os.getpid()}.lock", f"agent-{os.getpid()}.sock",
                                                f"agent-{os.getpid()}-code"])


def test_clean_stale_files_sweeps_the_agent_directory_inside_another_root(tmp_path, monkeypatch):
    """A target in a chroot (as in a container) has its agent directory inside its root: the
    start-up sweep finds it through the process and removes stale files there, not live ones."""
    from stacklens.inject.channel import agentdir

    monkeypatch.setattr(agentdir, "HOST_AGENT_DIR", tmp_path / "no-host-dir")
    root = tmp_path / "root"
    (root / "tmp").mkdir(parents=True)
    d = root / "tmp" / ".stacklens-agents"
    chrooted = subprocess.Popen(
        [sys.executable, "-c", "import os, sys\ntry:\n    os.chroot(sys.argv[1])\nexcept OSError as e:\n"
         "    print('no chroot', e, flush=True)\nelse:\n    print('ready', flush=True)\nsys.stdin.read()\n", str(root)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        said = chrooted.stdout.readline().strip()
        if said != "ready":
            pytest.skip(f"cannot chroot here ({said}); needs root")
        with AgentServer(chrooted.pid) as live:          # its default directory: inside its root
            assert Path(live.dir) == Path(f"/proc/{chrooted.pid}/root/tmp/.stacklens-agents")
            _leave_stale(d, 1)
            clean_stale_files()
            assert sorted(os.listdir(d)) == sorted(f"agent-{chrooted.pid}{s}" for s in (".lock", ".sock", "-code"))
        assert os.listdir(d) == []
    finally:
        chrooted.stdin.close()
        chrooted.wait()
