"""Attach latency, main-thread stop time, and the target's speed before / during / after attach.

Run as root from the repository root:  .venv/bin/python benchmarks/bench_inject.py [--windows N]
Prints a Markdown table (copied into docs/benchmarks/inject.md).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from stacklens.inject.channel.server import AgentServer
from stacklens.inject.injector import inject_agent
from stacklens.records.agent import PySample

ROOT = Path(__file__).resolve().parents[1]
TARGETS = ROOT / "tests" / "targets"


class RateTarget:
    def __init__(self, argv: list[str]) -> None:
        self.p = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
        assert self.p.stdout.readline() == "ready\n"
        self.rates: list[tuple[int, float, float]] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.p.stdout:
            _, t, r, c = line.split()
            self.rates.append((int(t), float(r), float(c)))

    def window(self, seconds: float) -> tuple[float, float]:
        """(units per wall second, units per main-thread CPU second) over the window."""
        t0 = time.monotonic_ns()
        time.sleep(seconds)
        t1 = time.monotonic_ns()
        vals = [(r, c) for t, r, c in self.rates if t0 < t <= t1]
        if not vals:
            return float("nan"), float("nan")
        return statistics.mean(v[0] for v in vals), statistics.mean(v[1] for v in vals)

    def close(self) -> None:
        self.p.kill()
        self.p.wait()


def bench_speed(kind: str, seconds: float, hz: float, rounds: int = 3) -> dict:
    """Phases interleaved (before, during, after) x rounds; medians, to resist noisy neighbours."""
    t = RateTarget([sys.executable, str(TARGETS / "inject_rate.py"), kind])
    ph: dict[str, list[tuple[float, float]]] = {"before": [], "during": [], "after": []}
    samples = 0
    try:
        time.sleep(1.0)
        with AgentServer(t.p.pid, Path(tempfile.mkdtemp()) / "agents", config={"sample_hz": hz}) as srv:
            for _ in range(rounds):
                ph["before"].append(t.window(seconds))
                inject_agent(t.p.pid, srv.path, timeout_s=10)
                time.sleep(0.5)
                srv.poll()
                ph["during"].append(t.window(seconds))
                samples += sum(isinstance(x, PySample) for x in srv.poll())
                srv.stop_agent()
                time.sleep(0.5)
                ph["after"].append(t.window(seconds))
    finally:
        t.close()
    out = {"kind": kind, "sample_hz": samples / (rounds * seconds)}
    for k, v in ph.items():
        out[k] = statistics.median(x[0] for x in v)
        out[k + "_cpu"] = statistics.median(x[1] for x in v)
    return out


def bench_latency(argv: list[str], n: int) -> dict:
    p = subprocess.Popen(argv, stdout=subprocess.PIPE, stdin=subprocess.PIPE, text=True)
    assert p.stdout.readline() == "ready\n"
    lat, stops, method = [], [], ""
    try:
        with AgentServer(p.pid, None if argv[0] == "chroot" else Path(tempfile.mkdtemp()) / "agents") as srv:
            for _ in range(n):
                r = inject_agent(p.pid, srv.path, timeout_s=10)
                lat.append(r.latency_s * 1e3)
                stops.append(r.stop_us)
                method = f"{r.method} {'.'.join(map(str, r.python))}"
                srv.stop_agent()
    finally:
        p.kill()
        p.wait()
    lat.sort()
    return {"method": method, "median_ms": statistics.median(lat), "p90_ms": lat[int(0.9 * (len(lat) - 1))],
            "max_ms": lat[-1], "stop_us_median": statistics.median(stops)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--windows", type=float, default=5.0, help="seconds per measurement window")
    ap.add_argument("-n", type=int, default=30, help="attaches per latency row")
    args = ap.parse_args()
    print(f"machine: {platform.node()} {platform.machine()}, {os.cpu_count()} CPUs, kernel {platform.release()}, "
          f"daemon Python {platform.python_version()}\n")
    print("| target | method | attach latency median / p90 / max (ms) | main thread stopped (µs, median) |")
    print("|---|---|---|---|")
    stop = Path(tempfile.mkdtemp()) / "stop"
    rows = [("busy pure-Python loop", [sys.executable, str(TARGETS / "inject_busy.py"), str(stop)]),
            ("idle (main thread in time.sleep(0.05) loop)",
             [sys.executable, "-c", "import time\nprint('ready', flush=True)\nwhile True: time.sleep(0.05)"])]
    if Path("/srv/sid/usr/bin/python3.14").exists():
        import shutil
        shutil.copy(TARGETS / "inject_busy.py", "/srv/sid/tmp/inject_busy.py")
        rows.append(("busy loop, CPython 3.14 in a chroot",
                     ["chroot", "/srv/sid", "python3.14", "/tmp/inject_busy.py", "/tmp/nostop"]))
    for name, argv in rows:
        r = bench_latency(argv, args.n)
        print(f"| {name} | {r['method']} | {r['median_ms']:.1f} / {r['p90_ms']:.1f} / {r['max_ms']:.1f} | "
              f"{r['stop_us_median']:.0f} |")
    print("\n| target | units/s before | during (agent, 100 Hz) | after detach | during/before | after/before "
          "| per main-thread CPU s: during/before, after/before | samples/s seen |")
    print("|---|---|---|---|---|---|---|---|")
    for kind in ("python", "torch"):
        s = bench_speed(kind, args.windows, 100.0)
        print(f"| {kind} loop | {s['before']:.1f} | {s['during']:.1f} | {s['after']:.1f} | "
              f"{s['during'] / s['before']:.3f} | {s['after'] / s['before']:.3f} | "
              f"{s['during_cpu'] / s['before_cpu']:.3f}, {s['after_cpu'] / s['before_cpu']:.3f} | {s['sample_hz']:.0f} |")


if __name__ == "__main__":
    main()
