"""CUPTI collector on a GPU: attach by PID to a running torch job, check the kernels of a known
sequence against torch.profiler, and time the job before, during and after the attach (the "after"
is measured before torch.profiler runs its reference in the same process; then once more after it).

Run as root on the GPU machine (see ../shared/device/README.md; cupti-python on PYTHONPATH):
    python benchmarks/gpu/bench_cupti.py [--json OUT.json]
Prints a JSON report; tests/gpu/test_cupti_collector.py asserts on the same numbers.
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
from collections import Counter, defaultdict
from pathlib import Path

from stacklens.introspect.demangle import demangle
from stacklens.inject.channel.server import AgentServer
from stacklens.inject.injector import inject_agent
from stacklens.records.agent import AgentStats, KernelRecord, Note

TARGET = Path(__file__).resolve().parents[2] / "tests" / "targets" / "inject_cuda.py"


class Job:
    def __init__(self) -> None:
        self.p = subprocess.Popen([sys.executable, str(TARGET)], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, text=True)
        assert self.p.stdout.readline() == "ready\n", "GPU target did not start"

    def cmd(self, line: str) -> str:
        self.p.stdin.write(line + "\n")
        self.p.stdin.flush()
        return self.p.stdout.readline().strip()

    def bench(self, steps: int = 5000, reps: int = 5) -> float:
        return min(float(self.cmd(f"bench {steps}").split()[1]) for _ in range(reps))

    def close(self) -> None:
        try:
            self.cmd("quit")
        finally:
            self.p.wait(30)


def spaced(job: Job, n: int) -> tuple[list[float], float]:
    """n measurements 0.5 s apart, and their median: the launch loop drifts by tens of percent over
    seconds on this machine, so phases are compared by medians (the test uses these)."""
    vals = []
    for _ in range(n):
        vals.append(job.bench())
        time.sleep(0.5)
    return vals, statistics.median(vals)


def run() -> dict:
    job = Job()
    report: dict = {}
    try:
        report["us_per_step_before_all"], report["us_per_step_before"] = spaced(job, 5)
        api = os.environ.get("STACKLENS_GPU_API_RECORDS", "0") == "1"
        report["gpu_api_records"] = api
        with AgentServer(job.p.pid, Path(tempfile.mkdtemp()) / "agents", config={"gpu_api_records": api}) as srv:
            res = inject_agent(job.p.pid, srv.path, timeout_s=30)
            report["attach_latency_s"] = res.latency_s
            deadline = time.monotonic() + 60
            notes: list[str] = []
            while time.monotonic() < deadline and not any("CUPTI activity collection on" in n for n in notes):
                notes += [r.message for r in srv.poll() if isinstance(r, Note)]
                time.sleep(0.1)
            report["notes"] = notes
            srv.poll()
            report["us_per_step_during"] = job.bench()
            # the benchmark made ~100k records: let the agent's backlog drain (its GPU queue is
            # bounded and drops when full) before the measured sequence runs
            quiet_since, end = time.monotonic(), time.monotonic() + 30
            backlog = 0
            while time.monotonic() < end and time.monotonic() - quiet_since < 1.5:
                got = srv.poll()
                backlog += len(got)
                if got:
                    quiet_since = time.monotonic()
                time.sleep(0.1)
            report["backlog_records_after_bench"] = backlog
            t0 = time.monotonic_ns()
            assert job.cmd("seq") == "done"
            t1 = time.monotonic_ns()
            time.sleep(1.0)
            recs = srv.poll()
            report["stop_agent_ok"] = srv.stop_agent(10)
            recs += srv.poll()
        # after detach, BEFORE torch.profiler runs its reference: Kineto's own CUPTI API tracing
        # leaves a cost in the process (pytorch#146604), which spoiled this measurement until
        # session 3 (docs/benchmarks/gpu.md)
        time.sleep(1.0)
        report["us_per_step_after_all"], report["us_per_step_after"] = spaced(job, 5)
        # the kernels of the sequence, by time: this also checks the CUPTI -> CLOCK_MONOTONIC calibration
        kernels = [r for r in recs if isinstance(r, KernelRecord) and t0 <= r.start_ns <= t1]
        all_k = [r for r in recs if isinstance(r, KernelRecord)]
        report["kernels_outside_window"] = len(all_k) - len(kernels)
        report["records_by_type"] = dict(Counter(type(r).__name__ for r in recs))
        report["window_ns"] = [t0, t1]
        report["kernel_start_range_ns"] = [min((r.start_ns for r in all_k), default=None),
                                           max((r.start_ns for r in all_k), default=None)]
        report["agent_stats"] = [{"gpu": r.gpu, "dropped": r.dropped} for r in recs if isinstance(r, AgentStats)][-1:]
        report["late_notes"] = [r.message for r in recs if isinstance(r, Note)]
        ours: dict[str, list[int]] = defaultdict(list)
        for k in kernels:
            ours[demangle(k.name)].append(k.duration_ns)   # CUPTI names are mangled; torch.profiler's are not
        prof = json.loads(job.cmd("prof").split(" ", 1)[1])
        compare = {}
        for name, (count, mean_ns) in prof.items():
            mine = ours.get(name, [])
            compare[name] = {"profiler_count": count, "our_count": len(mine),
                             "profiler_mean_ns": mean_ns,
                             "our_mean_ns": (sum(mine) / len(mine)) if mine else None}
        report["kernels"] = compare
        report["our_names_in_window"] = dict(Counter(demangle(k.name)[:160] for k in kernels))
        report["raw_names_in_window"] = sorted({k.name[:160] for k in kernels})[:10]
        # the same job after torch.profiler ran once: its residual cost, for comparison
        report["us_per_step_after_torch_profiler_all"], report["us_per_step_after_torch_profiler"] = spaced(job, 3)
    finally:
        job.close()
        out = os.environ.get("STACKLENS_GPU_OUT")
        if out:
            Path(out).mkdir(parents=True, exist_ok=True)
            (Path(out) / "bench_cupti.json").write_text(json.dumps(report, indent=2, default=str))
    return report


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", help="also write the report here")
    args = ap.parse_args()
    rep = run()
    text = json.dumps(rep, indent=2)
    print(text)
    if args.json:
        Path(args.json).write_text(text)


if __name__ == "__main__":
    main()
