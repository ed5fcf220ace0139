"""A 2-rank gloo DDP job on CPU through stacklensd (issue 31): what `attach --job` costs the job and
what the daemon sees.

    python benchmarks/bench_ddp_job.py [--seconds 20] [--rounds 3] [--json OUT]

Runs tests/targets/ddp_train.py under torchrun with SLOW_RANK=1, and a stacklensd of this
checkout on a private socket. Phases, each `--seconds` long, steps counted from the ranks'
`step` lines (the ranks step together: DDP's all-reduce joins them): never attached; then
`stacklens attach --job` (timed), attached; then `advise --job --json` (its finding and the
ranks' wait shares); then detached. Attached and detached phases alternate for `--rounds`
rounds (detach, measure, attach again), so the job's own drift shows as the spread of the
detached phases. Root (BPF).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))   # tests/ (the torchrun helper)

from tests.torchrun_job import TorchrunJob, free_port  # noqa: E402

DDP = ROOT / "tests" / "targets" / "ddp_train.py"
BIN = Path(sys.executable).parent


def steps_per_s(job: TorchrunJob, seconds: float) -> float:
    """Rank 0's steps per second over `seconds`, from its `step 0 N` lines (every 20 steps)."""
    job.drain()
    first = last = None
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        line = job.next_line(60, what="a step line")
        if line.startswith("step 0 "):
            n, t = int(line.split()[2]), time.monotonic()
            if first is None:
                first = (n, t)
            last = (n, t)
    if first is None or last is None or last[1] <= first[1]:
        raise RuntimeError("too few step lines: lengthen --seconds")
    return (last[0] - first[0]) / (last[1] - first[1])


def cli(sock: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / "stacklens"), "--socket", str(sock), *args], capture_output=True, text=True,
                          timeout=600)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json")
    a = ap.parse_args()
    out: dict = {"seconds": a.seconds, "rounds": a.rounds, "detached": [], "attached": [], "attach_s": []}
    tmp = Path(tempfile.mkdtemp(prefix="sl-ddp-"))
    sock = tmp / "s.sock"
    port = free_port()
    with open(tmp / "d.log", "w") as log:
        daemon = subprocess.Popen([str(BIN / "stacklensd"), "--socket", str(sock), "--metrics-address",
                                   f"127.0.0.1:{port}"], stdout=subprocess.PIPE, stderr=log, text=True)
    assert "ready" in daemon.stdout.readline()
    job = TorchrunJob(DDP, dict(os.environ, SLOW_RANK="1"))
    try:
        out["never_attached"] = steps_per_s(job, a.seconds)
        for _ in range(a.rounds):
            t0 = time.monotonic()
            r = cli(sock, "attach", "--job", str(job.launcher))
            if r.returncode != 0:
                raise RuntimeError(r.stdout + r.stderr)
            out["attach_s"].append(round(time.monotonic() - t0, 2))
            out["attached"].append(steps_per_s(job, a.seconds))
            adv = cli(sock, "advise", "--job", "--json", "--window", str(a.seconds), str(job.launcher))
            out["advice"] = json.loads(adv.stdout) if adv.returncode == 0 else adv.stderr
            for pid in job.ranks.values():
                cli(sock, "detach", str(pid))
            out["detached"].append(steps_per_s(job, a.seconds))
    finally:
        job.kill()
        daemon.terminate()
        daemon.wait(30)
    ctl = [out["never_attached"], *out["detached"]]
    out["summary"] = {
        "control_steps_per_s_median": statistics.median(ctl),
        "control_spread": [min(ctl), max(ctl)],
        "attached_steps_per_s_median": statistics.median(out["attached"]),
        "attached_over_control": statistics.median(ctl) / statistics.median(out["attached"]),
        "load_avg": os.getloadavg(),
    }
    text = json.dumps(out, indent=1)
    if a.json:
        Path(a.json).write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
