"""Why native stacks of CPU samples are cut (root + eBPF; no GPU), and what unwinding costs.

    sudo .venv/bin/python benchmarks/bench_native_stacks.py [SECONDS] [--hz 99] [--target PATH] [--fp-only]
         [--capture FILE] [--no-deep]
    .venv/bin/python benchmarks/bench_native_stacks.py --replay FILE [--profile]

Attaches a ProbeSession (CPU sampling + operator probes) to a torch CPU training loop
(tests/targets/torch_train.py by default) and, per CPU sample, reads:
- the unwound native stack as decode gives it (`Event.native_stack`): its depth, whether the
  unwind was cut (a leading `[truncated]`) and why (the walk hit STACK_DEPTH, or it reached an
  address outside every executable mapping or ended short of a thread entry), and the library
  of the outermost frame it reached (where frame-pointer walking broke);
- the joined path (daemon.join.splice.splice, as the joiner builds it): for samples under an
  `op:` frame, whether a `[truncated]` sits between the innermost op frame and the leaf, and
  whether that marker came from the unwind (decode) or from the join's own cap on native frames.
Prints one JSON object: counts, histograms of depth and of frames between operator and leaf,
and the overhead side: the target's CPU, this process's CPU per sample (decode + join), the
decoder's CPU for a sample's native stack, and the unwinder's per walked sample (all after the
first third of the run: the warm-up). `--capture` keeps the walked samples; `--replay` walks
them again offline: the unwinder's cost without the machine's noise, why walks are cut, and
the stack-copy size the walks needed.
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
from stacklens.daemon.join.splice import MAX_OP_NATIVE_FRAMES, splice  # noqa: E402


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


def run(seconds: float, hz: int, target: str, config: ProbeConfig | None = None, capture: str = "") -> dict:
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
            # the unwinder's CPU time and walks: [all, after the warm-up] (the first reads of each
            # address's CFI program are the warm-up's)
            unwind_s, unwind_n = [0.0, 0.0], [0, 0]
            warm = False
            dec = s._decoder
            captured: list[tuple[bytes, bytes]] = []
            if dec._cfi is not None:       # the unwinder's own CPU time, per sample it walks
                inner = dec._cfi.unwind

                def timed(*a):
                    if capture:
                        captured.append((bytes(a[0]), bytes(a[1])))
                    c = time.thread_time()
                    try:
                        return inner(*a)
                    finally:
                        c = time.thread_time() - c
                        unwind_s[0] += c
                        unwind_n[0] += 1
                        if warm:
                            unwind_s[1] += c
                            unwind_n[1] += 1
                dec._cfi.unwind = timed
            # a CPU sample's native stack in the decoder (symbolized fp walk, CFI walk, frames),
            # after the warm-up: what the unwinding costs per sample, fp-only or not
            stack_s, stack_n = [0.0], [0]
            inner_stack = dec._sample_stack

            def timed_stack(*a):
                c = time.thread_time()
                try:
                    return inner_stack(*a)
                finally:
                    if warm:
                        stack_s[0] += time.thread_time() - c
                        stack_n[0] += 1
            dec._sample_stack = timed_stack
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
            if capture:
                _save_capture(capture, p.pid, captured)
        finally:
            s.detach()
    finally:
        p.kill()
        p.wait()
    out = summarize(rows, cpu_decode / max(1, steady), stats)
    out["decoder"] = counts
    out["unwind_us_per_cfi_sample"] = round(1e6 * unwind_s[0] / max(1, unwind_n[0]), 1)
    out["sample_stack_us_per_sample_steady"] = round(1e6 * stack_s[0] / max(1, stack_n[0]), 1)
    out["unwind_us_per_cfi_sample_steady"] = round(1e6 * unwind_s[1] / max(1, unwind_n[1]), 1)
    # the target's progress: operator events per second (every op call is probed), its CPU use
    out["target_op_events_per_s"] = round(sum(other.values()) / wall, 1)
    out["target_cpu_cores"] = round(target_cpu, 3)
    return out


def _save_capture(path: str, pid: int, samples: list[tuple[bytes, bytes]]) -> None:
    """The walked samples (registers, stack copy) and the target's /proc/PID/maps, for walking
    them again offline (`--replay`)."""
    import pickle

    with open(path, "wb") as f:
        pickle.dump({"maps": open(f"/proc/{pid}/maps").read(), "samples": samples}, f)


def replay(path: str, profile: bool = False) -> dict:
    """Walks captured samples again in this process, twice (cold: each address's CFI program
    read; warm: rows cached): the unwinder's CPU per sample without the rest of the daemon or
    a busy machine's noise, why walks are cut, and how many bytes of stack the walks needed.
    The target's libraries must still be where the capture saw them (the same venv)."""
    import cProfile
    import pickle
    import pstats
    import tempfile

    from stacklens.bpf.decode import native_frames
    from stacklens.bpf.procmaps import NativeSymbolizer
    from stacklens.bpf.unwind import REGS_BYTES, REGS_WORDS, CfiUnwinder
    from stacklens.daemon.join.splice import _is_interp

    cap = pickle.load(open(path, "rb"))
    samples = cap["samples"]
    with tempfile.TemporaryDirectory() as proc:     # a /proc of one process: its maps, root "/"
        os.makedirs(f"{proc}/1")
        open(f"{proc}/1/maps", "w").write(cap["maps"])
        os.symlink("/", f"{proc}/1/root")
        sym = NativeSymbolizer(1, proc)
        u = CfiUnwinder(sym.mapping, sym.host_path, sym.known_mapping)
        out: dict = {"samples": len(samples)}
        for what in ("cold", "warm"):
            c = time.process_time()
            walks = [u.unwind(r, st) for r, st in samples]
            out[f"unwind_us_per_sample_{what}"] = round(1e6 * (time.process_time() - c) / max(1, len(samples)), 1)
        out["counts_per_pass"] = {k: v // 2 for k, v in u.counts.items()}
        if profile:
            pr = cProfile.Profile()
            pr.enable()
            for r, st in samples:
                u.unwind(r, st)
            pr.disable()
            pstats.Stats(pr, stream=sys.stderr).sort_stats("tottime").print_stats(12)
        cut = collections.Counter()
        need_all, need_interp = [], []
        for (r, st), (addrs, complete) in zip(samples, walks):
            frames = [sym.frame(a) for a in addrs]
            if not complete:
                cut[f"{_lib(frames[-1])} {frames[-1].name[:60]}"] += 1
                continue
            # the shortest copy that gives the same walk (all of it; up to the innermost
            # interpreter frame, which is what the join keeps below the Python frames)
            k = next((i for i, f in enumerate(frames) if _is_interp(f)), len(addrs) - 1)
            for need, upto in ((need_all, len(addrs)), (need_interp, k + 1)):
                lo, hi = 0, len(st)
                while hi - lo > 64:
                    mid = (lo + hi) // 2 & ~7
                    regs = bytearray(r[:REGS_BYTES])
                    regs[8 * REGS_WORDS:8 * REGS_WORDS + 8] = mid.to_bytes(8, "little")
                    if u.unwind(bytes(regs), st[:mid])[0][:upto] == addrs[:upto]:
                        hi = mid
                    else:
                        lo = mid
                need.append(hi)
        out["cut_at_outermost_frame"] = dict(cut.most_common(8))
        for name, need in (("copy_bytes_for_whole_walk", need_all), ("copy_bytes_to_interpreter", need_interp)):
            need.sort()
            n = max(1, len(need))
            out[name] = {"p50": need[n // 2], "p90": need[int(n * .9)], "p99": need[int(n * .99)], "max": need[-1],
                         "fit_pct": {k: round(100 * sum(x <= k for x in need) / n, 1)
                                     for k in (4096, 8192, 12288, 16384)}} if need else {}
        out["check_frames"] = sum(native_frames(a, sym.frame)[1] for a, _ in walks)  # cut by decode's rule
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
    ap.add_argument("--capture", default="", metavar="FILE",
                    help="save the walked samples and the target's mappings (pickle) for --replay")
    ap.add_argument("--replay", default="", metavar="FILE",
                    help="walk the samples of a --capture again offline (cost, cuts, stack bytes needed)")
    ap.add_argument("--profile", action="store_true", help="with --replay: cProfile of a warm pass")
    ap.add_argument("--no-deep", action="store_true",
                    help="no longer copy for samples whose operator is beyond the 16 KiB copy (-DSL_DEEP_COPY=0)")
    a = ap.parse_args()
    if a.replay:
        print(json.dumps(replay(a.replay, a.profile), indent=1))
        return 0
    cfg = ProbeConfig(cpu_sample_hz=a.hz, gpu=False, cfi_unwind=not a.fp_only,
                      extra_cflags=("-DSL_DEEP_COPY=0",) if a.no_deep else ())
    print(json.dumps(run(a.seconds, a.hz, a.target, cfg, a.capture), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
