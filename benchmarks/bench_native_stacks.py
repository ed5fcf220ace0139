"""Why native stacks of CPU samples are cut (root + eBPF; no GPU), and what unwinding costs.

    sudo .venv/bin/python benchmarks/bench_native_stacks.py [SECONDS] [--hz 99] [--target PATH]

Attaches a ProbeSession (CPU sampling + operator probes) to a torch CPU training loop
(tests/targets/torch_train.py by default) and, per CPU sample, reads:
- the unwound native stack as decode gives it (`Event.native_stack`): its depth, whether the
  unwind was cut (a leading `[truncated]`) and why (the walk hit STACK_DEPTH, or it reached an
  address outside every executable mapping or ended short of a thread entry), and the library
  of the outermost frame it reached (where frame-pointer walking broke);
- the joined path (daemon.join.joiner.splice, as the joiner builds it): for samples under an
  `op:` frame, whether a `[truncated]` sits between the innermost op frame and the leaf, and
  whether that marker came from the unwind (decode) or from the join's own cap on native frames.
Prints one JSON object: counts, histograms of depth and of frames between operator and leaf,
and the overhead side: the target's step time (it prints none, so the sample rate) and this
process's CPU per sample (decode + join).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

from stacklens.bpf import ProbeConfig, ProbeSession  # noqa: E402
from stacklens.bpf.decode import STACK_DEPTH, TRUNCATED  # noqa: E402
from stacklens.cct import Frame  # noqa: E402
from stacklens.daemon.join.joiner import MAX_OP_NATIVE_FRAMES, splice  # noqa: E402


def _lib(f: Frame) -> str:
    return os.path.basename(f.file) if f.kind == "native" else f.name


def classify(ev) -> dict:
    """One CPU sample -> what its stacks say (see the module docstring)."""
    nat = tuple(ev.native_stack)
    cut = bool(nat) and nat[0] == TRUNCATED
    real = [f for f in nat if f != TRUNCATED]
    out = {"depth": len(real), "cut": cut, "ops": bool(ev.op_path)}
    if cut:
        out["why"] = "depth" if len(real) >= STACK_DEPTH - 1 else "walk_broke"
        out["outermost"] = _lib(real[0]) if real else "(nothing)"
        out["outermost_fn"] = real[0].name if real else "(nothing)"
    path = splice(tuple(ev.py_stack), tuple(getattr(ev, "py_entries", ()) or ()), tuple(ev.op_path), nat)
    if ev.op_path:
        last_op = max(i for i, f in enumerate(path) if f.kind == "op")
        below = path[last_op + 1:]
        out["below_op"] = len(below)
        tr = [i for i, f in enumerate(below) if f == TRUNCATED]
        out["truncated_below_op"] = bool(tr)
        if tr:
            # the joiner's marker replaces frames it dropped; decode's leads the unwound frames
            out["marker_from"] = "unwind" if cut and not any(f.kind == "native" for f in below[:tr[0]]) \
                and _native_below_op(nat) <= MAX_OP_NATIVE_FRAMES else "join_cap"
        out["native_below_op"] = _native_below_op(nat)
        out["leaf"] = _lib(path[-1]) if path else ""
    return out


def _native_below_op(nat) -> int:
    """Native frames from the first operator-library frame to the leaf (0 if none)."""
    for i, f in enumerate(nat):
        if f.kind == "native" and (f.name.startswith("at::_ops::") or os.path.basename(f.file).startswith("libtorch_cpu")):
            return len(nat) - i
    return 0


def run(seconds: float, hz: int, target: str, config: ProbeConfig | None = None) -> dict:
    p = subprocess.Popen([sys.executable, target], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        if p.stdout.readline().strip() != "ready":
            raise SystemExit("target did not start")
        s = ProbeSession(p.pid, config or ProbeConfig(cpu_sample_hz=hz, gpu=False))
        s.attach()
        rows: list[dict] = []
        cpu_decode = 0.0
        steady = 0          # samples decoded after the warm-up (symbol tables, CFI of each library read)
        other = collections.Counter()
        try:
            unwind_s = [0.0]
            dec = s._decoder
            if dec._cfi is not None:       # the unwinder's own CPU time, per sample it walks
                inner = dec._cfi.unwind

                def timed(*a):
                    c = time.thread_time()
                    try:
                        return inner(*a)
                    finally:
                        unwind_s[0] += time.thread_time() - c
                dec._cfi.unwind = timed
            t0 = time.monotonic()
            tick = os.sysconf("SC_CLK_TCK")
            while time.monotonic() - t0 < seconds:
                warm = time.monotonic() - t0 >= seconds / 3
                if warm and not steady:
                    t_cpu0 = _proc_cpu(p.pid, tick)
                    t_w0 = time.monotonic()
                c0 = time.process_time()
                evs = s.poll(200)
                for e in evs:
                    if e.kind == "cpu_sample":
                        rows.append(classify(e))
                        steady += warm
                    elif warm:
                        other[e.kind] += 1
                if warm:
                    cpu_decode += time.process_time() - c0
            target_cpu = (_proc_cpu(p.pid, tick) - t_cpu0) / (time.monotonic() - t_w0)
            wall = time.monotonic() - t_w0
            stats = s.stats()
            dec = s._decoder
            counts = dict(dec.counts) | (dict(dec._cfi.counts) if dec._cfi is not None else {})
        finally:
            s.detach()
    finally:
        p.kill()
        p.wait()
    out = summarize(rows, cpu_decode / max(1, steady), stats)
    out["decoder"] = counts
    out["unwind_us_per_cfi_sample"] = round(1e6 * unwind_s[0] / max(1, counts.get("unwinds", 0)), 1)
    # the target's progress: operator events per second (every op call is probed), its CPU use
    out["target_op_events_per_s"] = round(sum(other.values()) / wall, 1)
    out["target_cpu_cores"] = round(target_cpu, 3)
    return out


def _proc_cpu(pid: int, tick: int) -> float:
    f = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / tick


def summarize(rows: list[dict], cpu_per_sample: float, stats: dict) -> dict:
    n = len(rows)
    under = [r for r in rows if r["ops"]]
    cut = [r for r in rows if r["cut"]]
    bucket = lambda v: f"{(v // 8) * 8}-{(v // 8) * 8 + 7}"  # noqa: E731
    return {
        "samples": n,
        "under_op": len(under),
        "unwind_cut": len(cut),
        "unwind_cut_why": dict(collections.Counter(r["why"] for r in cut)),
        "unwind_cut_outermost_lib": dict(collections.Counter(r["outermost"] for r in cut).most_common(8)),
        "unwind_cut_outermost_fn": dict(collections.Counter(r["outermost_fn"] for r in cut).most_common(8)),
        "depth_hist": dict(sorted(collections.Counter(bucket(r["depth"]) for r in rows).items())),
        "native_below_op_hist": dict(sorted(collections.Counter(bucket(r["native_below_op"]) for r in under).items())),
        "under_op_truncated": sum(r["truncated_below_op"] for r in under),
        "under_op_truncated_from": dict(collections.Counter(r.get("marker_from") for r in under
                                                            if r["truncated_below_op"])),
        "under_op_unbroken_pct": round(100.0 * sum(not r["truncated_below_op"] for r in under) / max(1, len(under)), 1),
        "leaf_libs": dict(collections.Counter(r["leaf"] for r in under).most_common(6)),
        "stack_errors": stats.get("stack_errors"),
        "daemon_cpu_us_per_sample": round(1e6 * cpu_per_sample, 1),  # poll: read, decode, unwind, this script's join
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("seconds", type=float, nargs="?", default=30.0)
    ap.add_argument("--hz", type=int, default=99)
    ap.add_argument("--target", default=str(ROOT / "tests" / "targets" / "torch_train.py"))
    ap.add_argument("--fp-only", action="store_true", help="the old unwinding: frame pointers only (no stack copy)")
    a = ap.parse_args()
    cfg = ProbeConfig(cpu_sample_hz=a.hz, gpu=False, cfi_unwind=not a.fp_only)
    print(json.dumps(run(a.seconds, a.hz, a.target, cfg), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
