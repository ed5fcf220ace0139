"""Soak benchmark for stacklensd (issue 6, acceptance 5): continuous events from several targets.

Starts the real daemon (subprocess), several targets launching through the fake libcuda at a
fixed rate plus a torch CPU training loop, attaches them all over gRPC, and samples the
daemon's RSS, CPU time and event/drop counters. Reports RSS growth after warm-up, drops, and
daemon CPU per 10,000 events/s. Needs root (BPF) and a C compiler (fake libcuda).

    .venv/bin/python benchmarks/bench_soak.py --duration 1800 --out docs/benchmarks/soak.md
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TARGETS = ROOT / "tests" / "targets"
FAKES = ROOT / "tests" / "fakes"
BIN = Path(sys.executable).parent
CLK = os.sysconf("SC_CLK_TCK")


def build_fakes(d: Path) -> None:
    cc = shutil.which("cc") or shutil.which("gcc")
    flags = ["-O1", "-g", "-fno-omit-frame-pointer", "-fPIC", "-shared"]
    subprocess.run([cc, *flags, "-o", str(d / "libcuda.so.1"), str(FAKES / "fake_cuda.c")], check=True)


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--duration", type=float, default=1800.0)
    ap.add_argument("--warmup", type=float, default=120.0)
    ap.add_argument("--interval", type=float, default=15.0)
    ap.add_argument("--cuda-targets", type=int, default=3)
    ap.add_argument("--gap-us", type=int, default=400, help="launch period of each fake-CUDA target")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    from stacklens.daemon.client import DaemonClient

    tmp = Path(tempfile.mkdtemp(prefix="stacklens-soak-"))
    build_fakes(tmp)
    sock = tmp / "run" / "s.sock"
    log = open(tmp / "daemon.log", "w")
    daemon = subprocess.Popen(
        [str(BIN / "stacklensd"), "--socket", str(sock), "--metrics-address", "off"], stdout=subprocess.PIPE, stderr=log, text=True
    )
    assert "ready" in daemon.stdout.readline()
    procs = []
    try:
        n_launch = 10**12
        for _ in range(args.cuda_targets):
            p = subprocess.Popen(
                [sys.executable, str(TARGETS / "fake_cuda_bench.py"), str(tmp)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
            )
            assert p.stdout.readline().strip() == "ready"
            p.stdin.write(f"paced {n_launch} {args.gap_us * 1000}\n")
            p.stdin.flush()
            procs.append(p)
        torch_t = subprocess.Popen(
            [sys.executable, "-m", "stacklens.cli.demo_workload"], stdout=subprocess.PIPE, text=True
        )
        assert torch_t.stdout.readline().startswith("ready")
        procs.append(torch_t)
        with DaemonClient(str(sock), timeout=120) as c:
            for p in procs:
                c.attach(p.pid)
            t0 = time.monotonic()
            rows = []
            lossy: dict[str, int] = {}
            saved: dict[str, int] = {}  # events the ring refused but a retry / the fallback delivered
            while time.monotonic() - t0 < args.duration:
                time.sleep(args.interval)
                h = c.health().counters
                lossy.update({k: int(v) for k, v in h.items() if "drop" in k or "lost" in k})
                saved.update({k: int(v) for k, v in h.items() if "fallback" in k or "retry" in k})
                rows.append(
                    (
                        time.monotonic() - t0,
                        rss_kib(daemon.pid),
                        cpu_s(daemon.pid),
                        int(h.get("bpf_events", h.get("events", 0))),
                        sum(int(v) for k, v in h.items() if "drop" in k or "lost" in k),
                    )
                )
                t, rss, cpu, ev, drops = rows[-1]
                print(f"t={t:7.0f}s rss={rss / 1024:7.1f} MiB cpu={cpu:8.1f}s events={ev:>12} drops={drops} "
                      f"{ {k: v for k, v in lossy.items() if v} }", flush=True)
    finally:
        for p in procs:
            p.kill()
            p.wait()
        daemon.terminate()
        daemon.wait(30)
        log.close()
    warm = [r for r in rows if r[0] >= args.warmup] or rows
    first, last = warm[0], warm[-1]
    growth = 100.0 * (last[1] - first[1]) / first[1]
    span = last[0] - first[0] or 1.0
    ev_rate = (last[3] - first[3]) / span
    cpu_share = (last[2] - first[2]) / span
    per10k = cpu_share / (ev_rate / 10_000) if ev_rate else float("nan")
    report = [
        "# stacklensd soak benchmark",
        "",
        f"- load average at the end: {' '.join(f'{x:.1f}' for x in os.getloadavg())} (1/5/15 min)",
        f"- command: `.venv/bin/python benchmarks/bench_soak.py --duration {args.duration:g} --warmup {args.warmup:g} "
        f"--cuda-targets {args.cuda_targets} --gap-us {args.gap_us}`",
        f"- machine: {platform.node()}, {os.cpu_count()} CPUs, kernel {platform.release()}, Python {platform.python_version()}",
        f"- targets: {args.cuda_targets} fake-libcuda launch loops (one launch every {args.gap_us} us each) + the torch "
        "demo training loop (op probes, CPU samples), all attached at once",
        "",
        "| measure | value |",
        "|---|---|",
        f"| daemon RSS after warm-up ({first[0]:.0f} s) | {first[1] / 1024:.1f} MiB |",
        f"| daemon RSS at the end ({last[0]:.0f} s) | {last[1] / 1024:.1f} MiB |",
        f"| RSS growth after warm-up | {growth:+.2f}% (target < 5%) |",
        f"| events/s into the daemon | {ev_rate:,.0f} |",
        f"| drops + lost samples (whole run) | {last[4]} |",
        f"| ring drops (`bpf_drops`, whole run) | {lossy.get('bpf_drops', 0)} |",
        "| by counter (whole run) | " + (", ".join(f"`{k}` {v}" for k, v in sorted(lossy.items())) or "none") + " |",
        "| refused by the ring, delivered anyway | " + (", ".join(f"`{k}` {v}" for k, v in sorted(saved.items())) or "none") + " |",
        f"| daemon CPU | {100 * cpu_share:.1f}% of one core |",
        f"| daemon CPU per 10,000 events/s | {100 * per10k:.1f}% of one core |",
        "",
        "Samples (t s, RSS MiB, daemon CPU s, events, drops):",
        "",
        "```",
        *(f"{t:7.0f} {rss / 1024:8.1f} {cpu:8.1f} {ev:>12} {dr}" for t, rss, cpu, ev, dr in rows),
        "```",
    ]
    text = "\n".join(report) + "\n"
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
