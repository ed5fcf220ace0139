"""One-shot profiling without a daemon (`stacklens profile`, `stacklens record`), like `py-spy record`.

Requires root (BPF; ptrace when --agent). The target is left as it was when this returns.
"""

from __future__ import annotations

import subprocess
import time

from stacklens.cct import Snapshot
from stacklens.daemon.session import ProcessSession, pid_alive


def profile_pid(
    pid: int, *, duration_s: float, agent: bool = False, cpu_hz: int = 99, ops: bool = True, session_factory=ProcessSession
) -> Snapshot:
    s = session_factory(pid, agent=agent, cpu_hz=cpu_hz, ops=ops)
    s.start()
    try:
        deadline = time.monotonic() + duration_s
        while time.monotonic() < deadline and s.state == "attached":
            time.sleep(min(0.1, max(0.0, deadline - time.monotonic())))
        return s.snapshot()
    finally:
        s.stop()


def record_command(cmd: list[str], *, agent: bool = False, cpu_hz: int = 99) -> Snapshot:
    proc = subprocess.Popen(cmd)
    try:
        time.sleep(0.05)  # let the exec happen so the probes see the new image
        s = ProcessSession(proc.pid, agent=agent, cpu_hz=cpu_hz)
        s.start()
        try:
            while proc.poll() is None and pid_alive(proc.pid):
                time.sleep(0.1)
            return s.snapshot()
        finally:
            s.stop()
    finally:
        if proc.poll() is None:
            proc.wait()
