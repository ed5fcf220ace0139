"""Issue 23 acceptance 1: `stacklens profile --pid P --duration D --format json` under load.

Root (BPF). Starts HOGS CPU hogs (`sh -c 'while :; do :; done'`), a busy pure-Python target
(tests/targets/named_loop.py) and a busy torch loop (tests/targets/torch_train.py), and runs the
CLI RUNS times on each. The target's CPU time is read here, independently of stacklens, from
/proc/P/stat (utime + stime) every 20 ms, and taken at the window the profile reports (its
meta.window start/end, CLOCK_MONOTONIC) by interpolation. A run passes when cpu_samples is
within 25% of rate x that CPU time, or when it failed with a message.

    sudo .venv/bin/python benchmarks/bench_oneshot.py --runs 10 --duration 10 [--hogs 2]

Acceptance 2 (`--record`): `stacklens record -- python PROG` of a program that burns CPU_S
seconds of CPU and prints what it measured itself (time.process_time): samples against rate x
that, the share rooted at its <module>, `[stale code object]` frames.

    sudo .venv/bin/python benchmarks/bench_oneshot.py --record --runs 3 --duration 6 --hogs 2
"""

from __future__ import annotations

import argparse
import bisect
import json
import os
import re
import resource
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TARGETS = {"python": ["named_loop.py", "busy_fn"], "torch": ["torch_train.py"]}


def cpu_ns(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            f = fh.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(f[11]) + int(f[12])) * 1_000_000_000 // os.sysconf("SC_CLK_TCK")


class CpuTrace(threading.Thread):
    """(monotonic ns, CPU ns) of a process every `period_s`."""

    def __init__(self, pid: int, period_s: float = 0.02):
        super().__init__(daemon=True)
        self.pid, self.period_s = pid, period_s
        self.t: list[int] = []
        self.c: list[int] = []
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.wait(self.period_s):
            c = cpu_ns(self.pid)
            if c is not None:
                self.t.append(time.monotonic_ns())
                self.c.append(c)

    def at(self, t: int) -> float:
        i = bisect.bisect_left(self.t, t)
        if i <= 0 or i >= len(self.t):
            raise ValueError("time outside the trace")
        t0, t1, c0, c1 = self.t[i - 1], self.t[i], self.c[i - 1], self.c[i]
        return c0 + (c1 - c0) * (t - t0) / (t1 - t0)


def start_target(kind: str) -> subprocess.Popen:
    script, *args = TARGETS[kind]
    p = subprocess.Popen([sys.executable, str(ROOT / "tests" / "targets" / script), *args],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=str(ROOT))
    line = p.stdout.readline().strip()
    if line != "ready":
        raise RuntimeError(f"{script}: {line!r}")
    return p


def one_run(pid: int, duration: float, rate: int, trace: CpuTrace, socket: str | None = None,
            daemon_pid: int | None = None) -> dict:
    """One `stacklens profile`; with `socket`, through the stacklensd there (its compiled program),
    else `--no-daemon`. Wall time, time to "collecting", the CLI's CPU time, the daemon's."""
    stacklens = Path(sys.executable).parent / "stacklens"
    where = ["--socket", socket] if socket else []
    cli0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    d0 = cpu_ns(daemon_pid) if daemon_pid else None
    t0 = time.monotonic()
    r = subprocess.run([str(stacklens), *where, "profile", "--pid", str(pid), "--duration", str(duration),
                        "--format", "json", "--rate", str(rate), *([] if socket else ["--no-daemon"])],
                       capture_output=True, text=True)
    cli1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    out = {"rc": r.returncode, "wall_s": round(time.monotonic() - t0, 1),
           "cli_cpu_s": round(cli1.ru_utime + cli1.ru_stime - cli0.ru_utime - cli0.ru_stime, 2)}
    if daemon_pid:
        out["daemon_cpu_s"] = round((cpu_ns(daemon_pid) - d0) / 1e9, 2)
    m = re.search(r"\[\s*([0-9.]+)s\] collecting", r.stderr)
    out["to_collecting_s"] = float(m.group(1)) if m else None
    err = [ln for ln in r.stderr.splitlines() if "error" in ln]
    if r.returncode != 0 or not r.stdout.strip():
        out["error"] = err[-1] if err else r.stderr.strip().splitlines()[-1:]
    if r.stdout.strip():
        w = json.loads(r.stdout)["meta"]["window"]
        ext = (trace.at(w["end_ns"]) - trace.at(w["start_ns"])) / 1e9
        due = rate * ext
        out.update(window_s=w["seconds"], cpu_samples=w["cpu_samples"], cpu_s_external=round(ext, 3),
                   cpu_s_stacklens=w["target_cpu_s"], due=round(due), ratio=round(w["cpu_samples"] / due, 3)
                   if due else None, dropped=w.get("events_dropped"), late=w.get("events_late"),
                   unjoined=w.get("unjoined"), drain_s=w.get("drain_s"))
    out["ok"] = (out.get("ratio") is not None and abs(out["ratio"] - 1) <= 0.25) or \
        (r.returncode != 0 and bool(out.get("error")))
    return out


RECORD_PROG = """\
import time
t0 = time.process_time()

def work(n):
    s = 0
    for i in range(n):
        s += i * i
    return s

while time.process_time() - t0 < {cpu_s}:
    work(10000)
print("cpu", time.process_time())
"""


def record_run(cpu_s: float, rate: int) -> dict:
    import tempfile

    from stacklens.cct import export
    from stacklens.render.folded import to_folded

    stacklens = Path(sys.executable).parent / "stacklens"
    with tempfile.TemporaryDirectory() as d:
        prog, out = Path(d) / "prog.py", Path(d) / "rec.json"
        prog.write_text(RECORD_PROG.format(cpu_s=cpu_s))
        t0 = time.monotonic()
        r = subprocess.run([str(stacklens), "record", "--rate", str(rate), "--format", "json", "-o", str(out),
                            "--", sys.executable, str(prog)], capture_output=True, text=True)
        row = {"rc": r.returncode, "wall_s": round(time.monotonic() - t0, 1)}
        if r.returncode != 0:
            row["error"] = r.stderr.strip().splitlines()[-1:]
            row["ok"] = True
            return row
        own = float(r.stdout.split()[-1])
        snap = export.load(out)
    rows = [ln.rsplit(" ", 1) for ln in to_folded(snap, "cpu_samples").splitlines()]
    total = sum(int(n) for _, n in rows)
    at_module = sum(int(n) for p, n in rows if p.split(";")[0].startswith(f"<module> ({prog.name}:"))
    stale = sum(int(n) for p, n in rows if "stale code object" in p)
    due = rate * own
    row.update(cpu_samples=total, own_cpu_s=own, due=round(due), ratio=round(total / due, 3),
               at_module=round(at_module / total, 4) if total else 0, stale=stale,
               window_s=snap.meta["window"]["seconds"])
    row["ok"] = abs(row["ratio"] - 1) <= 0.25 and row["at_module"] >= 0.95 and stale == 0
    return row


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--duration", type=float, default=10)
    ap.add_argument("--rate", type=int, default=99)
    ap.add_argument("--hogs", type=int, default=2)
    ap.add_argument("--targets", default="python,torch")
    ap.add_argument("--record", action="store_true", help="acceptance 2: record of a --duration s CPU program")
    ap.add_argument("--socket", help="profile through the stacklensd listening here (issue 28 acceptance 4)")
    ap.add_argument("--daemon-pid", type=int, help="that daemon's PID: its CPU time per profile is reported")
    args = ap.parse_args()
    hogs = [subprocess.Popen(["sh", "-c", "while :; do :; done"]) for _ in range(args.hogs)]
    results = {}
    try:
        if args.record:
            rows = []
            for i in range(args.runs):
                row = record_run(args.duration, args.rate)
                print(json.dumps({"target": "record", "hogs": args.hogs, "run": i + 1, **row}), flush=True)
                rows.append(row)
            results["record"] = rows
        for kind in ([] if args.record else args.targets.split(",")):
            t = start_target(kind)
            trace = CpuTrace(t.pid)
            trace.start()
            try:
                rows = []
                for i in range(args.runs):
                    row = one_run(t.pid, args.duration, args.rate, trace, args.socket, args.daemon_pid)
                    print(json.dumps({"target": kind, "run": i + 1, **row}), flush=True)
                    rows.append(row)
                results[kind] = rows
            finally:
                trace.stop.set()
                t.kill()
                t.wait()
    finally:
        for h in hogs:
            h.kill()
            h.wait()
    bad = [(k, i + 1) for k, rows in results.items() for i, r in enumerate(rows) if not r["ok"]]
    print(json.dumps({"summary": {k: [r.get("ratio") for r in rows] for k, rows in results.items()},
                      "failed": bad, "load": os.getloadavg()}), flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
