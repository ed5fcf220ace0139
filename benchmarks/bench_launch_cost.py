"""Where a launch's cost goes on the CPU stand-in of batch-1 decoding (issue 42), root + eBPF, no GPU.

    sudo .venv/bin/python benchmarks/bench_launch_cost.py [--steps 300] [--rounds 5] [--json OUT]

The target (tests/targets/decode_standin.py) launches 110 tiny kernels per "decode step" one by
one from Python lines through the fake libcuda, pinned to CPU 0; this process (the probes' ring
reader) is pinned to CPU 1, as stacklensd would run beside a decode server. Each round measures,
on the same process, one phase after another in an order that alternates between rounds:

- `none`: nothing attached (the base launch rate);
- `uprobe floor`: an empty BPF program on cuLaunchKernel (what any uprobe costs here);
- `launch probe`: our launch program, no stacks;
- `+ Python walk`: and the Python stack walk in BPF;
- `+ native stack`: and the native stack (the launch probe as a profile uses it);
- `full session`: the whole ProbeSession as `profile` attaches it (99 Hz CPU sampling too).

Per phase: the launch rate relative to `none` in the same round, from the target's CPU time per
launch (`CPU rate`: what a dedicated CPU gives, steady on a loaded machine) and from wall time
(`wall rate`, median over rounds with its range: what this machine gave), the added target CPU
per launch, the BPF program's run time per hit (the kernel's BPF stats),
and the reader's CPU per event (poll, decode) on the other CPU. The rest of a hit's cost is the
uprobe trap (entry into the kernel and back) and cache effects.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from stacklens.bpf import ProbeConfig, ProbeSession  # noqa: E402
from benchmarks.bench_probes import build_fakes  # noqa: E402
from stacklens.bpf.costs import RunStats  # noqa: E402
from tests.bpf.conftest import Target  # noqa: E402

TARGET_CPU, READER_CPU = 0, 1
PHASES = {
    "launch probe": ProbeConfig(cpu_sample_hz=0, ops=False, native_stacks=False, python_stacks=False),
    "+ Python walk": ProbeConfig(cpu_sample_hz=0, ops=False, native_stacks=False),
    "+ native stack": ProbeConfig(cpu_sample_hz=0, ops=False),
    "full session": ProbeConfig(),
}


def steps(t: Target, n: int) -> tuple[int, float, float]:
    t.send(f"steps {n}")
    _, launches, wall, cpu = t.readline(timeout=600).split()
    return int(launches), float(wall), float(cpu)


class Reader:
    """Drains a ProbeSession on this (pinned) thread, counting events and its own CPU time."""

    def __init__(self, s: ProbeSession) -> None:
        self.s, self.events, self.cpu_s = s, 0, 0.0
        self._stop = threading.Event()
        self._th = threading.Thread(target=self._run)
        self._th.start()

    def _run(self) -> None:
        c0 = time.thread_time()
        while not self._stop.is_set():
            self.events += len(self.s.poll(20))
        self.events += len(self.s.poll(0))
        self.cpu_s = time.thread_time() - c0

    def stop(self) -> None:
        self._stop.set()
        self._th.join()


def measured(t: Target, n: int, prog_fd: int | None) -> dict:
    stats = RunStats() if prog_fd is not None else None
    try:
        r0, c0 = RunStats.of(prog_fd) if prog_fd is not None else (0, 0)
        launches, wall, cpu = steps(t, n)
        r1, c1 = RunStats.of(prog_fd) if prog_fd is not None else (0, 0)
    finally:
        if stats is not None:
            stats.close()
    out = {"launches": launches, "rate": launches / wall, "cpu_us_per_launch": cpu / launches * 1e6}
    if prog_fd is not None and c1 > c0:
        out["bpf_ns_per_hit"] = (r1 - r0) / (c1 - c0)
    return out


def phase_empty(t: Target, libdir: Path, n: int) -> dict:
    """The uprobe floor: an empty program on cuLaunchKernel (bpf/costs.py's, no compiler)."""
    from stacklens.bpf.costs import load_empty_uprobe_program
    from stacklens.bpf.uprobe_multi import attach_uprobe_multi
    from stacklens.introspect.elf import ElfFile

    with ElfFile(str(libdir / "libcuda.so.1")) as elf:
        off = elf.symbol_offsets(["cuLaunchKernel"])["cuLaunchKernel"]
    prog = load_empty_uprobe_program()
    try:
        link = attach_uprobe_multi(prog, str(libdir / "libcuda.so.1"), [off], [0], pid=t.pid)
        try:
            return measured(t, n, prog)
        finally:
            os.close(link)
    finally:
        os.close(prog)


def phase_session(t: Target, n: int, cfg: ProbeConfig) -> dict:
    s = ProbeSession(t.pid, cfg)
    s.attach()
    reader = Reader(s)
    try:
        prog = s._attacher._api_entry
        row = measured(t, n, prog.fd if prog is not None else None)
    finally:
        reader.stop()
        st = s.stats()
        s.detach()
    row["reader_us_per_event"] = reader.cpu_s / max(1, reader.events) * 1e6
    row["events"], row["drops"] = reader.events, st.get("drops", 0)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=300, help="decode steps per measurement (110 launches each)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json")
    args = ap.parse_args()
    os.sched_setaffinity(0, {READER_CPU})
    with tempfile.TemporaryDirectory() as d:
        libdir = build_fakes(Path(d))
        t = Target("decode_standin.py", str(libdir), str(TARGET_CPU))
        rounds = []
        try:
            steps(t, args.steps)                        # warm
            for i in range(args.rounds):
                order = ["uprobe floor", *PHASES]
                if i % 2:
                    order.reverse()
                row = {"none": measured(t, args.steps, None)}
                for name in order:
                    row[name] = (phase_empty(t, libdir, args.steps) if name == "uprobe floor"
                                 else phase_session(t, args.steps, PHASES[name]))
                row["none after"] = measured(t, args.steps, None)
                rounds.append(row)
                print(f"round {i + 1}: " + ", ".join(
                    f"{k} {v['rate'] / ((row['none']['rate'] + row['none after']['rate']) / 2):.2f}"
                    for k, v in row.items()), flush=True)
        finally:
            t.kill()
    report(rounds, args)


def report(rounds: list[dict], args) -> None:
    names = list(rounds[0])
    table = {}
    for name in names:
        rel = [r[name]["rate"] / ((r["none"]["rate"] + r["none after"]["rate"]) / 2) for r in rounds]
        base_cpu = [(r["none"]["cpu_us_per_launch"] + r["none after"]["cpu_us_per_launch"]) / 2 for r in rounds]
        added = [r[name]["cpu_us_per_launch"] - b for r, b in zip(rounds, base_cpu)]
        by_cpu = [b / r[name]["cpu_us_per_launch"] for r, b in zip(rounds, base_cpu)]
        row = {"cpu_rate_vs_base": statistics.median(by_cpu), "rate_vs_base": statistics.median(rel),
               "range": [min(rel), max(rel)],
               "us_per_launch": statistics.median(r[name]["cpu_us_per_launch"] for r in rounds),
               "added_us_per_launch": statistics.median(added)}
        for k in ("bpf_ns_per_hit", "reader_us_per_event"):
            vals = [r[name][k] for r in rounds if k in r[name]]
            if vals:
                row[k] = statistics.median(vals)
        row["drops"] = sum(r[name].get("drops", 0) for r in rounds)
        table[name] = row
    head = (f"{'phase':16} {'CPU rate':>8} {'wall rate':>9} {'range':>13} {'µs/launch':>9} {'added µs':>8} "
            f"{'BPF ns/hit':>10} {'reader µs/ev':>12}")
    print(head)
    for name, r in table.items():
        print(f"{name:16} {r['cpu_rate_vs_base']:8.2f} {r['rate_vs_base']:9.2f} {r['range'][0]:6.2f}-{r['range'][1]:<6.2f} "
              f"{r['us_per_launch']:9.2f} "
              f"{r['added_us_per_launch']:8.2f} {r.get('bpf_ns_per_hit', float('nan')):10.0f} "
              f"{r.get('reader_us_per_event', float('nan')):12.2f}")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    meta = {"commit": commit, "machine": f"{platform.node()} {os.cpu_count()} CPUs {platform.release()}",
            "steps": args.steps, "rounds": args.rounds, "launches_per_step": rounds[0]["none"]["launches"] // args.steps}
    print(json.dumps(meta))
    if args.json:
        Path(args.json).write_text(json.dumps({"meta": meta, "table": table, "rounds": rounds}, indent=1))


if __name__ == "__main__":
    main()
