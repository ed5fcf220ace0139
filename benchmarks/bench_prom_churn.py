"""Hotspot series churn and the `[other]` share over a long scrape of a real daemon.

Starts `.venv/bin/stacklensd --metrics-hotspots` on a private socket and port, two real targets
(tests/targets/named_loop.py and the torch CPU training loop tests/targets/torch_train.py),
attaches both, then GETs /metrics every --interval seconds for --duration seconds (default 600).
Per scrape: the `[other]` share of hotspot CPU (cumulative, and of the CPU added since the
previous scrape), the hotspot series present. At the end: each hotspot series' appearances and
disappearances, `promtool check metrics` on the last scrape, the numbers as JSON (--json) and as
text. Requires root (the daemon's probes). Kills the daemon and the targets it started.

    sudo .venv/bin/python benchmarks/bench_prom_churn.py --duration 600 --interval 5
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parent.parent
PY = ROOT / ".venv" / "bin" / "python"
DAEMON = ROOT / ".venv" / "bin" / "stacklensd"
TARGETS = ROOT / "tests" / "targets"
CPU = "stacklens_hotspot_cpu_seconds"
OTHER = "[other]"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_target(argv: list[str]) -> subprocess.Popen:
    """A target that prints `ready`; stdin stays open (torch_train exits when it closes)."""
    p = subprocess.Popen([str(PY), *argv], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    line = p.stdout.readline()
    if line.strip() != "ready":
        p.kill()
        raise RuntimeError(f"{argv[0]} did not print ready: {line!r}")
    return p


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=60) as r:
        return r.read().decode()


def hotspot_samples(text: str) -> dict[tuple[str, str, str, str], float]:
    """(family, pid, context, line) → value of every hotspot series."""
    out = {}
    for fam in text_string_to_metric_families(text):
        if not fam.name.startswith("stacklens_hotspot_"):
            continue
        for s in fam.samples:
            if s.name.endswith("_total"):
                out[(fam.name, s.labels["pid"], s.labels["context"], s.labels["line"])] = s.value
    return out


def other_share(samples: dict, prev: dict | None = None) -> tuple[float, float]:
    """([other], all) CPU seconds of the hotspot CPU family, cumulative or added since `prev`."""
    other = total = 0.0
    for key, v in samples.items():
        if key[0] != CPU:
            continue
        if prev is not None:
            v = max(0.0, v - prev.get(key, 0.0))
        total += v
        if key[2] == OTHER:
            other += v
    return other, total


def returned(key, history: list[set]) -> bool:
    """Whether a series was exported, then not, then again (the acceptance: appear once, end once)."""
    seen = gone = False
    for h in history:
        if key in h:
            if gone:
                return True
            seen = True
        elif seen:
            gone = True
    return False


def commit() -> str:
    r = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return r.stdout.strip() or "unknown"


def run(duration: float, interval: float, out: Path | None) -> dict:
    code = commit()   # the code the daemon runs (HEAD may move while the scrape goes on)
    tmp = Path(tempfile.mkdtemp(prefix="bench_prom_churn."))
    port = free_port()
    sock = tmp / "stacklens.sock"
    procs: list[subprocess.Popen] = []
    daemon = subprocess.Popen([str(DAEMON), "--socket", str(sock), "--metrics-address", f"127.0.0.1:{port}",
                               "--metrics-hotspots", "--log-level", "WARNING"], stderr=open(tmp / "daemon.log", "w"))
    try:
        procs.append(start_target([str(TARGETS / "named_loop.py"), "bench_hot_loop", "0.5"]))
        procs.append(start_target([str(TARGETS / "torch_train.py")]))
        from stacklens.daemon.client import DaemonClient

        deadline = time.monotonic() + 30
        while not sock.exists():
            if daemon.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"stacklensd did not start: {(tmp / 'daemon.log').read_text()[-2000:]}")
            time.sleep(0.1)
        with DaemonClient(str(sock), timeout=60) as c:
            for p in procs:
                c.attach(p.pid)
        pids = {str(p.pid) for p in procs}
        history: list[set] = []
        scrape_s: list[float] = []
        shares: list[dict] = []
        first = prev = None
        t0 = time.monotonic()
        n = 0
        text = ""
        while True:
            ts = time.monotonic()
            text = scrape(port)
            scrape_s.append(time.monotonic() - ts)
            samples = {k: v for k, v in hotspot_samples(text).items() if k[1] in pids}
            history.append(set(samples))
            o, t = other_share(samples)
            row = {"t": round(time.monotonic() - t0, 1), "series": len(samples), "other_share": o / t if t else 0.0}
            if prev is not None:
                od, td = other_share(samples, prev)
                row["other_share_interval"] = od / td if td else 0.0
            shares.append(row)
            first = first or samples
            prev = samples
            n += 1
            left = duration - (time.monotonic() - t0)
            if left <= 0:
                break
            time.sleep(min(interval, left))
        appear: collections.Counter = collections.Counter()
        disappear: collections.Counter = collections.Counter()
        for before, after in zip(history, history[1:]):
            appear.update(after - before)
            disappear.update(before - after)
        od, td = other_share(prev, first)
        lint = None
        if shutil.which("promtool"):
            r = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, text=True)
            lint = {"rc": r.returncode, "output": (r.stdout + r.stderr).strip()}
        everseen = set().union(*history)
        result = {
            "commit": code, "duration_s": duration, "interval_s": interval, "scrapes": n,
            "scrape_s_median": sorted(scrape_s)[len(scrape_s) // 2], "scrape_s_max": max(scrape_s),
            "hotspot_series_ever": len(everseen),
            "hotspot_series_max": max(len(h) for h in history),
            "series_reappearing": sum(1 for k in everseen if appear[k] > 0 and k in history[0] or appear[k] > 1),
            "series_returning": sum(1 for k in everseen if returned(k, history)),
            "series_disappearing_more_than_once": sum(1 for k in everseen if disappear[k] > 1),
            "series_flapping": sum(1 for k in everseen if appear[k] + disappear[k] > 1),
            "appearances_after_first_scrape": sum(appear.values()),
            "disappearances": sum(disappear.values()),
            "other_share_last": shares[-1]["other_share"],
            "other_share_max_after_60s": max((s["other_share"] for s in shares if s["t"] >= 60), default=None),
            "other_share_of_cpu_added_over_run": od / td if td else None,
            "other_share_interval_max_after_60s": max((s.get("other_share_interval", 0) for s in shares if s["t"] >= 60),
                                                      default=None),
            "promtool": lint,
            "series_ending_twice_or_returning": sorted(f"{k[0]} {k[1]} {k[2]} | {k[3]}" for k in everseen
                                                       if disappear[k] > 1 or appear[k] > 1
                                                       or (appear[k] and k in history[0])),
            "last_cpu_series": sorted(f"{k[1]} {k[2]} | {k[3]} = {v:.2f}" for k, v in prev.items() if k[0] == CPU),
            "per_scrape": shares,
        }
        if out is not None:
            out.write_text(json.dumps(result, indent=1))
        return result
    finally:
        for p in procs:
            p.kill()
            p.wait()
        daemon.terminate()
        try:
            daemon.wait(20)
        except subprocess.TimeoutExpired:
            daemon.kill()
            daemon.wait()
        shutil.rmtree(tmp, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--duration", type=float, default=600.0, help="seconds of scraping (default 600)")
    ap.add_argument("--interval", type=float, default=5.0, help="seconds between scrapes (default 5)")
    ap.add_argument("--json", type=Path, help="also write the results here")
    args = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("run as root: the daemon attaches eBPF probes")
    r = run(args.duration, args.interval, args.json)
    for k, v in r.items():
        if k == "per_scrape":
            continue
        if k == "last_cpu_series":
            print("last scrape's CPU hotspot series:")
            for line in v:
                print("   ", line)
            continue
        print(f"{k}: {v}")


if __name__ == "__main__":
    main()
