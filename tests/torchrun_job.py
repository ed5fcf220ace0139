"""A torchrun job for tests: `nproc` ranks of a target script on CPU, in a session of its own
(killed as a group at the end), its output (the ranks share it) read by a thread into a queue.
The target prints `ready RANK PID` once per rank; `ranks` maps rank -> PID after the start.
"""

from __future__ import annotations

import os
import queue
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class TorchrunJob:
    def __init__(self, target: Path, env: dict[str, str], nproc: int = 2, ready_s: float = 120) -> None:
        torchrun = Path(sys.executable).with_name("torchrun")
        self.proc = subprocess.Popen(
            [str(torchrun), "--nnodes=1", f"--nproc-per-node={nproc}", "--master-addr=127.0.0.1",
             f"--master-port={free_port()}", str(target)],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=str(ROOT),
            env=env, start_new_session=True)
        self.launcher = self.proc.pid
        self.lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self.ranks: dict[int, int] = {}
        try:
            while len(self.ranks) < nproc:
                line = self.next_line(ready_s, what="every rank's 'ready'")
                if line.startswith("ready "):
                    _, rank, pid = line.split()
                    self.ranks[int(rank)] = int(pid)
        except BaseException:
            self.kill()
            raise

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.put(line.rstrip("\n"))
        self.lines.put("")              # EOF

    def next_line(self, timeout: float, what: str = "a line") -> str:
        try:
            line = self.lines.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"no {what} from the torchrun job in {timeout} s") from None
        if line == "" and self.proc.poll() is not None:
            raise AssertionError(f"the torchrun job exited ({self.proc.returncode}) waiting for {what}")
        return line

    def drain(self) -> None:
        while not self.lines.empty():
            self.lines.get_nowait()

    def kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)   # the group this test started
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=15)
        except ProcessLookupError:
            pass
        for pid in self.ranks.values():               # ranks are in the group; make sure
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
