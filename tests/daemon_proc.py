"""A real stacklensd of this checkout for tests: private socket, metrics on a free local port,
its log in the test's directory; and `until`, a wait on a condition instead of a sleep."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from tests.torchrun_job import free_port

BIN = Path(sys.executable).parent


class Daemon:
    def __init__(self, tmp: Path, env: dict[str, str] | None = None) -> None:
        self.sock = tmp / "s.sock"
        self.port = free_port()
        self.log = tmp / "stacklensd.log"
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen([str(BIN / "stacklensd"), "--socket", str(self.sock), "--metrics-address",
                                          f"127.0.0.1:{self.port}"], stdout=subprocess.PIPE, stderr=log, text=True,
                                         env=env)
        line = self.proc.stdout.readline()
        assert "ready" in line, (line, self.log.read_text())

    def cli(self, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
        return subprocess.run([str(BIN / "stacklens"), "--socket", str(self.sock), *args], capture_output=True,
                              text=True, timeout=timeout)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc.stdout.close()


def until(what: str, check, timeout: float = 180.0):
    """`check()`'s first truthy value, asked again as the profile grows, within `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        v = check()
        if v:
            return v
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout:g} s")
        time.sleep(0.5)
