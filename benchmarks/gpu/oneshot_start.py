"""Issue 28 acceptance 4 on the GPU machine: how long `stacklens profile` takes to start collecting
on a GPU process, compiling its own program (`--no-daemon`) and through a running stacklensd (its
program compiled at its warm-up), probes only and with the agent; then the daemon's advice and the
profile of the agent windows are kept (issue 29's recorded inputs).

    bash benchmarks/gpu/oneshot_start.sh          (the device: carry [".device"]; results under $OUT)
    python benchmarks/gpu/oneshot_start.py --out DIR [--workloads decode,eager_train] [--duration S]

Writes DIR/oneshot_start.json (one row per profile: wall, time to "collecting", the CLI's CPU
time, the daemon's CPU time over it), DIR/oneshot_start.md, DIR/<workload>-agent.json (a profile)
and DIR/<workload>-advice.json.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TARGET = REPO / "tests" / "targets" / "safety_workloads.py"
CLI = [sys.executable, "-m", "stacklens.cli.main"]


def cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as fh:
        f = fh.read().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")


def profile(sock: Path, pid: int, duration: float, daemon_pid: int, *extra: str) -> dict:
    c0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    d0 = cpu_s(daemon_pid)
    t0 = time.monotonic()
    r = subprocess.run([*CLI, "--socket", str(sock), "profile", "-p", str(pid), "-d", str(duration),
                        "-f", "json", *extra], capture_output=True, text=True, timeout=300)
    c1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    m = re.search(r"\[\s*([0-9.]+)s\] collecting", r.stderr)
    row = {"args": " ".join(extra) or "(through the daemon, probes)", "rc": r.returncode,
           "wall_s": round(time.monotonic() - t0, 2), "to_collecting_s": float(m.group(1)) if m else None,
           "cli_cpu_s": round(c1.ru_utime + c1.ru_stime - c0.ru_utime - c0.ru_stime, 2),
           "daemon_cpu_s": round(cpu_s(daemon_pid) - d0, 2),
           "through_daemon": "through stacklensd" in r.stderr}
    if r.returncode != 0:
        row["stderr"] = r.stderr[-800:]
    else:
        row["_profile"] = r.stdout
        try:
            from stacklens.cct import export

            tmp = Path(os.environ.get("TMPDIR", "/tmp")) / f"oneshot-{os.getpid()}.json"
            tmp.write_text(r.stdout)
            snap = export.load(str(tmp))
            row["kernels"] = None if "kernel_count" in snap.unavailable else snap.total("kernel_count")
            row["cpu_samples"] = snap.total("cpu_samples")
        except Exception as e:  # noqa: BLE001 - reported in the row
            row["load_error"] = str(e)[:200]
    return row


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--workloads", default="decode,eager_train")
    ap.add_argument("--duration", type=float, default=5.0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    sock = Path(tempfile.mkdtemp(prefix="sl-oneshot-")) / "s.sock"     # short: a socket path has 108 bytes
    log = open(out / "stacklensd.log", "w")
    t0 = time.monotonic()
    d = subprocess.Popen([sys.executable, "-m", "stacklens.daemon.server", "--socket", str(sock),
                          "--metrics-address", "off"], stdout=subprocess.PIPE, stderr=log, text=True)
    assert "ready" in d.stdout.readline()
    print(f"[{time.monotonic() - t0:6.1f}s] stacklensd ready", flush=True)
    rows, targets = [], []
    try:
        for w in a.workloads.split(","):
            t = subprocess.Popen([sys.executable, str(TARGET), w, "--device", a.device, "--log", str(out / f"ep-{w}.jsonl")],
                                 stdout=subprocess.PIPE, stderr=open(out / f"stderr-{w}.log", "wb"), text=True)
            targets.append(t)
            for line in t.stdout:
                if line.strip() == "ready":
                    break
            print(f"[{time.monotonic() - t0:6.1f}s] {w} ready (pid {t.pid})", flush=True)
            plan = [("--no-daemon",)] + [()] * a.repeats + [("--agent",)] * 2 + [("--agent", "--no-daemon")]
            for extra in plan:
                row = profile(sock, t.pid, a.duration, d.pid, *extra)
                row["workload"] = w
                prof = row.pop("_profile", None)
                if prof and extra == ("--agent",):
                    (out / f"{w}-agent.json").write_text(prof)
                rows.append(row)
                print(f"[{time.monotonic() - t0:6.1f}s] {json.dumps(row)[:400]}", flush=True)
            # the advice on a window of the agent's (issue 29: which finding comes first on GPU jobs)
            subprocess.run([*CLI, "--socket", str(sock), "attach", str(t.pid), "--agent"], capture_output=True, timeout=300)
            time.sleep(10)
            r = subprocess.run([*CLI, "--socket", str(sock), "advise", str(t.pid), "--json"], capture_output=True,
                               text=True, timeout=300)
            (out / f"{w}-advice.json").write_text(r.stdout or r.stderr)
            subprocess.run([*CLI, "--socket", str(sock), "detach", str(t.pid)], capture_output=True, timeout=300)
    finally:
        for t in targets:
            t.terminate()
        d.terminate()
        d.wait(30)
    (out / "oneshot_start.json").write_text(json.dumps(rows, indent=1))
    md = ["| workload | how | rc | wall s | to collecting s | CLI CPU s | daemon CPU s |", "|---|---|---|---|---|---|---|"]
    md += [f"| {r['workload']} | {r['args']} | {r['rc']} | {r['wall_s']} | {r['to_collecting_s']} | {r['cli_cpu_s']} | "
           f"{r['daemon_cpu_s']} |" for r in rows]
    (out / "oneshot_start.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
