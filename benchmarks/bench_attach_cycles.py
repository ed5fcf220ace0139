"""Daemon RSS over attach/detach cycles of distinct processes, with real probes (issue 17 point 8).

Run as root from the repository root:  .venv/bin/python benchmarks/bench_attach_cycles.py [--cycles 30]

Starts stacklensd (private socket, no metrics), then per cycle: a fresh idle Python target,
`attach`, a snapshot, `detach`, kill. Prints the daemon's RSS with one session attached (the
"one-session level") and after each cycle; the target is the end RSS within 20% of that level.
One BCC compile per cycle: ~3-5 s each on a 2-vCPU VM.
"""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
TARGET = REPO / "tests" / "targets" / "inject_sleep.py"


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cycles", type=int, default=30)
    args = ap.parse_args()
    from stacklens.daemon.client import DaemonClient

    with tempfile.TemporaryDirectory() as tmp:
        sock = Path(tmp) / "run" / "s.sock"
        d = subprocess.Popen([str(BIN / "stacklensd"), "--socket", str(sock), "--metrics-address", "off"],
                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        assert "ready" in d.stdout.readline()
        print(f"daemon RSS at start: {rss_mib(d.pid):.1f} MiB", flush=True)
        one_session = None
        t0 = time.monotonic()
        try:
            with DaemonClient(str(sock), timeout=60) as c:
                for i in range(args.cycles):
                    t = subprocess.Popen([sys.executable, str(TARGET)], stdout=subprocess.PIPE, text=True)
                    assert t.stdout.readline().strip() == "ready"
                    c.attach(t.pid)
                    c.snapshot(t.pid)
                    if one_session is None:
                        one_session = rss_mib(d.pid)
                        print(f"one session attached: {one_session:.1f} MiB", flush=True)
                    c.detach(t.pid)
                    t.kill()
                    t.wait()
                    t.stdout.close()
                    print(f"cycle {i + 1:3d}: {rss_mib(d.pid):.1f} MiB ({time.monotonic() - t0:.0f} s)", flush=True)
            end = rss_mib(d.pid)
        finally:
            d.send_signal(signal.SIGTERM)
            d.wait(30)
    print(f"end after {args.cycles} cycles: {end:.1f} MiB = {end / one_session:.2f}x the one-session level "
          f"(target <= 1.20x)")
    return 0 if end <= 1.2 * one_session else 1


if __name__ == "__main__":
    sys.exit(main())
