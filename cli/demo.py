"""`stacklens demo`: start the bundled PyTorch workload, attach to it by PID, show the live tree.

Requires root (BPF). The workload is stopped when the demo ends.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

from stacklens.daemon.session import ProcessSession
from stacklens.render.textreport import render_report, short_note
from stacklens.errors import AttachError


def start_workload(seconds: float | None = None) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "stacklens.cli.demo_workload"]
    if seconds:
        cmd.append(str(seconds))
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    if not line.startswith("ready"):
        proc.kill()
        raise AttachError(f"the demo workload did not start (got {line!r}); is torch installed? run scripts/setup.sh")
    return proc


def run_demo(duration_s: float | None = None, metric: str = "cpu_samples", live_view=None) -> int:
    """`live_view(session, title=, duration_s=)` shows the tree (the CLI passes the TUI's); without
    one, a text report every second."""
    proc = start_workload()
    print(f"demo: started the workload (pid {proc.pid}); attaching by PID …", flush=True)
    try:
        session = ProcessSession(proc.pid, agent=False)
        t0 = time.monotonic()
        for note in session.start():
            print(f"demo: {short_note(note, proc.pid)}")
        print(f"demo: attached in {time.monotonic() - t0:.2f}s", flush=True)
        try:
            if live_view is not None:
                return live_view(session, title=f"stacklens demo — pid {proc.pid}", duration_s=duration_s)
            deadline = None if duration_s is None else time.monotonic() + duration_s
            while deadline is None or time.monotonic() < deadline:
                time.sleep(1.0 if deadline is None else min(1.0, max(0.0, deadline - time.monotonic())))
                snap = session.snapshot()
                if sys.stdout.isatty():
                    os.system("clear")
                print(render_report(snap, metric, max_depth=14, min_share=0.02), flush=True)
        finally:
            session.stop()
    except KeyboardInterrupt:
        pass
    finally:
        proc.kill()
        proc.wait()
    return 0
