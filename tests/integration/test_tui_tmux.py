"""End to end in a real terminal: stacklensd + a torch target + `stacklens top PID` inside tmux.

Needs tmux, torch and a daemon that can attach (root with working eBPF); skips with the reason
otherwise. Reads the screen with `tmux capture-pane`.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

BIN = Path(sys.executable).parent
STACKLENS = str(BIN / "stacklens")
STACKLENSD = str(BIN / "stacklensd")

# The target lives here rather than in tests/targets/ only because this test owns no other
# path; it follows the same protocol (print `ready`, then loop until killed).
TARGET = '''
import torch

torch.set_num_threads(1)
a = torch.randn(256, 256)
b = torch.randn(256, 256)


def hot_matmul_step():
    c = a
    for _ in range(20):
        c = torch.mm(c, b) * 0.01
    return c


print("ready", flush=True)
while True:
    hot_matmul_step()
'''

NOT_ATTACHABLE = re.compile(r"permission|not permitted|root|CAP_|bpf|bcc|kernel headers|tracefs|ptrace", re.I)


BOUND_S = 60.0   # for what must show up: a bound on a busy machine, not the expected latency
VALUE = r"\d[\d.]*(?:k|M|G|ns|us|ms|s)?"  # a count (1.2k) or a time (CPU samples at the daemon's rate: 330.0ms)


def _wait_for(predicate, timeout: float, interval: float = 0.1):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    return predicate()


class Tmux:
    """One session on a private tmux server (-L), so other tmux users' options do not apply."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.server = ["tmux", "-L", name]

    def start(self, command: str, width: int = 160, height: int = 50) -> None:
        subprocess.run(
            [*self.server, "new-session", "-d", "-s", self.name, "-x", str(width), "-y", str(height), command],
            check=True,
        )

    def screen(self) -> str:
        r = subprocess.run([*self.server, "capture-pane", "-p", "-t", self.name], capture_output=True, text=True)
        return r.stdout

    def keys(self, *keys: str) -> None:
        subprocess.run([*self.server, "send-keys", "-t", self.name, *keys], check=True)

    def alive(self) -> bool:
        return subprocess.run([*self.server, "has-session", "-t", self.name], capture_output=True).returncode == 0

    def kill(self) -> None:
        subprocess.run([*self.server, "kill-server"], capture_output=True)


@pytest.fixture
def stack(tmp_path):
    """(socket, target pid): a daemon on a private socket and a torch target, both killed after."""
    if shutil.which("tmux") is None:
        pytest.skip("tmux is not installed")
    pytest.importorskip("torch")
    procs: list[subprocess.Popen] = []
    sock = tmp_path / "s.sock"
    daemon_log = open(tmp_path / "daemon.log", "w")
    try:
        daemon = subprocess.Popen(
            [STACKLENSD, "--socket", str(sock), "--metrics-address", "off"],
            stdout=daemon_log,
            stderr=subprocess.STDOUT,
        )
        procs.append(daemon)
        if not _wait_for(lambda: sock.exists() and (tmp_path / "token").exists(), 20):
            pytest.fail(f"stacklensd did not start: {(tmp_path / 'daemon.log').read_text()[-2000:]}")
        script = tmp_path / "target.py"
        script.write_text(TARGET)
        target = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        procs.append(target)
        line = target.stdout.readline()
        assert line.startswith("ready"), f"target did not start: {line!r}"
        yield str(sock), target.pid, daemon
    finally:
        for p in reversed(procs):
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)
        daemon_log.close()


def test_top_shows_hot_function_and_op_and_updates(stack, tmp_path):
    sock, pid, daemon = stack
    attach = subprocess.run(
        [STACKLENS, "--socket", sock, "attach", "--agent", str(pid)], capture_output=True, text=True, timeout=120
    )
    if attach.returncode != 0:
        why = (attach.stderr or attach.stdout).strip()
        if os.geteuid() != 0 or NOT_ATTACHABLE.search(why):
            pytest.skip(f"the daemon cannot attach here: {why}")
        pytest.fail(f"attach failed (rc {attach.returncode}): {why}")
    attached_at = time.monotonic()

    tmux = Tmux(f"stacklens-test-{os.getpid()}")
    exit_file = tmp_path / "top.exit"
    # Textual draws on stderr: it stays on the terminal, and a traceback would show in the pane
    # pytest's COLUMNS/LINES would override the pane's real size
    tmux.start(f"env -u COLUMNS -u LINES {STACKLENS} --socket {sock} top {pid}; echo $? > {exit_file}; sleep 30")
    try:
        # the hot operator, with numbers (within ~1-2 s of attach on a quiet machine; the bound is
        # for a busy one: CI under load took longer than 5 s; the time is printed)
        op_row = re.compile(rf"^\S*\s+({VALUE})\s+\S+\s+[\d.]+%.*aten::mm", re.M)
        first = _wait_for(lambda: op_row.search(tmux.screen()), BOUND_S)
        assert first, f"aten::mm not on screen within {BOUND_S} s of attach:\n{tmux.screen()}"
        print(f"aten::mm on screen {time.monotonic() - attached_at:.1f} s after the attach")
        assert f"pid {pid}" in tmux.screen() and "attached" in tmux.screen()

        # the hot Python function: it is in the agent's Python
        # samples, a metric of their own until the daemon joins them with the probes' op paths
        presses = 0

        def python_visible() -> bool:
            nonlocal presses
            if "hot_matmul_step" in tmux.screen():
                return True
            tmux.keys("m")
            presses += 1
            time.sleep(0.2)
            return "hot_matmul_step" in tmux.screen()

        shown = _wait_for(python_visible, BOUND_S, interval=0.05)
        assert shown, f"hot_matmul_step not on screen within {BOUND_S} s of attach:\n{tmux.screen()}"
        print(f"hot_matmul_step on screen {time.monotonic() - attached_at:.1f} s after the attach")
        assert re.search(rf"^\S*\s+{VALUE}\s+.*hot_matmul_step", tmux.screen(), re.M), tmux.screen()

        # back to CPU time (samples / the daemon's rate): the numbers update (cumulative samples keep growing). The top row,
        # not the op's: once the agent's samples join the probes' op paths, aten::mm moves under
        # the Python frames that called it, below a collapsed row
        tmux.keys(*["M"] * presses)
        top_row = re.compile(rf"^\S*\s+({VALUE})\s+\S+\s+[\d.]+%", re.M)
        assert _wait_for(lambda: "cpu time" in tmux.screen() and top_row.search(tmux.screen()), 30.0), tmux.screen()
        first = top_row.search(tmux.screen())
        updated = _wait_for(
            lambda: (m := top_row.search(tmux.screen())) is not None and m.group(1) != first.group(1) and m, 30.0
        )
        assert updated, f"the numbers did not change in 30 s (still {first.group(1)}):\n{tmux.screen()}"

        # the views respond to keys
        tmux.keys("h")
        assert _wait_for(lambda: "frame" in tmux.screen() and "context" in tmux.screen(), 30.0), tmux.screen()
        tmux.keys("t")

        # the daemon going away is a message, not a traceback
        daemon.terminate()
        daemon.wait(timeout=30)
        assert _wait_for(lambda: "lost the daemon" in tmux.screen(), 30.0), tmux.screen()
        assert "Traceback" not in tmux.screen()

        tmux.keys("q")
        assert _wait_for(exit_file.exists, 30.0), f"top did not quit:\n{tmux.screen()}"
        assert exit_file.read_text().strip() == "0"
        assert "Traceback" not in tmux.screen()
    finally:
        tmux.kill()
