"""Benchmarks of the stacklens BPF probes (root + eBPF; no GPU).

    sudo .venv/bin/python benchmarks/bench_probes.py [--quick] [--only ops] [--json OUT]

1. per-launch probe cost: fake-libcuda tight C loop of cuLaunchKernel, without / with / after
2. op-probe overhead: torch tiny-MLP training loop, interleaved rounds of no probes / our op
   program on the default op set and on all 3,101 ops / an empty program on each of the two
   offset sets, hits per step and BPF run time per hit; after detach
3. events per second the loader sustains with zero drops (fake-libcuda loop, poll() decoding)
4. attach and detach time for all probes (GPU API + ~3,100 op probes + CPU sampling)
Each measurement in one run, same target process before/during/after, median of repeats.
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
from tests.bpf.conftest import FAKES, Target  # noqa: E402


def build_fakes(d: Path) -> Path:
    for src, out in (("fake_cuda.c", "libcuda.so.1"),):
        subprocess.run(["cc", "-O1", "-fno-omit-frame-pointer", "-mno-omit-leaf-frame-pointer", "-fPIC", "-shared", "-o", str(d / out),
                        str(FAKES / src)], check=True)
    return d


def run(t: Target, cmd: str) -> float:
    t.send(cmd)
    line = t.readline(timeout=600)
    return float(line.split()[1])


def median_of(t: Target, cmd: str, reps: int) -> float:
    return statistics.median(run(t, cmd) for _ in range(reps))


def bench_launch(libdir: Path, n: int, reps: int) -> dict:
    t = Target("fake_cuda_bench.py", str(libdir))
    try:
        base = median_of(t, f"loop {n}", reps)
        res = {"empty BPF program (uprobe floor)": empty_probe_cost(t, libdir, n, reps, base)}
        for label, cfg in (("entry probe, no stack", ProbeConfig(cpu_sample_hz=0, ops=False, native_stacks=False)),
                           ("entry probe + native stack", ProbeConfig(cpu_sample_hz=0, ops=False)),
                           ("entry probe + native stack, unwound every launch (no reuse)",
                            ProbeConfig(cpu_sample_hz=0, ops=False, extra_cflags=("-DSL_NO_NATIVE_REUSE",)))):
            s = ProbeSession(t.pid, cfg)
            s.attach()
            stop = threading.Event()
            got = [0]

            def drain():
                while not stop.is_set():
                    got[0] += len(s.poll(50))

            th = threading.Thread(target=drain)
            th.start()
            with_probe = median_of(t, f"loop {n}", reps)
            stop.set()
            th.join()
            got[0] += len(s.poll(0))
            st = s.stats()
            s.detach()
            res[label] = {"s_per_loop": with_probe, "us_per_launch": with_probe / n * 1e6,
                          "probe_cost_us": (with_probe - base) / n * 1e6, "events": got[0], "drops": st["drops"]}
        after = median_of(t, f"loop {n}", reps)
    finally:
        t.kill()
    return {"launches_per_loop": n, "baseline_us_per_launch": base / n * 1e6, **res,
            "after_detach_us_per_launch": after / n * 1e6}


def empty_probe_cost(t: Target, libdir: Path, n: int, reps: int, base: float) -> dict:
    """The same loop with an empty program on cuLaunchKernel: what a uprobe hit costs here."""
    from bcc import BPF

    from stacklens.introspect.elf import ElfFile
    from stacklens.bpf.uprobe_multi import BPF_TRACE_UPROBE_MULTI, attach_uprobe_multi

    with ElfFile(str(libdir / "libcuda.so.1")) as elf:
        off = elf.symbol_offsets(["cuLaunchKernel"])["cuLaunchKernel"]
    b = BPF(text=b"int sl_empty(struct pt_regs *ctx) { return 0; }")
    fn = b.load_func(b"sl_empty", BPF.KPROBE, attach_type=BPF_TRACE_UPROBE_MULTI)
    fd = attach_uprobe_multi(fn.fd, str(libdir / "libcuda.so.1"), [off], [0], pid=t.pid)
    try:
        s = median_of(t, f"loop {n}", reps)
    finally:
        os.close(fd)
        b.cleanup()
    return {"s_per_loop": s, "us_per_launch": s / n * 1e6, "probe_cost_us": (s - base) / n * 1e6}


def bench_pystack_at_probes(libdir: Path, n: int, reps: int, depths=(1, 10, 30)) -> dict:
    """Added cost per launch-probe hit of the in-BPF Python walk: the same target and loop,
    sessions without and with python_stacks attached in turn (no native stacks, so only the
    walk differs), at several Python depths (`deep D N`: the C loop called from D frames)."""
    t = Target("fake_cuda_bench.py", str(libdir))
    out = {}
    try:
        for d in depths:
            row = {}
            for label, py in (("without", False), ("with", True)):
                s = ProbeSession(t.pid, ProbeConfig(cpu_sample_hz=0, ops=False, native_stacks=False,
                                                    python_stacks=py))
                s.attach()
                stop = threading.Event()

                def drain():
                    while not stop.is_set():
                        s.poll(50)

                th = threading.Thread(target=drain)
                th.start()
                row[label] = median_of(t, f"deep {d} {n}", reps) / n * 1e6
                stop.set()
                th.join()
                s.poll(0)
                st = s.stats()
                s.detach()
                if py:
                    row["py_stacks_symbolized"] = st["py_stacks_symbolized"]
                    row["py_stack_errors"] = st["py_stack_errors"]
            row["added_us_per_hit"] = row["with"] - row["without"]
            out[f"depth {d} (+1 <module>)"] = row
    finally:
        t.kill()
    return {"launches_per_loop": n, "us_per_launch": out}


def _bpf_stats_fd() -> int:
    """BPF_ENABLE_STATS(BPF_STATS_RUN_TIME): programs count run_time_ns/run_cnt while the fd is open."""
    import ctypes as ct

    libc = ct.CDLL(None, use_errno=True)
    libc.syscall.restype = ct.c_long
    attr = (ct.c_uint32 * 32)()  # type = 0: BPF_STATS_RUN_TIME
    fd = libc.syscall(321, 32, ct.byref(attr), ct.sizeof(attr))
    if fd < 0:
        raise OSError(ct.get_errno(), "BPF_ENABLE_STATS")
    return fd


def _prog_run_stats(prog_fd: int) -> tuple[int, int]:
    d = {}
    with open(f"/proc/self/fdinfo/{prog_fd}") as f:
        for line in f:
            k, _, v = line.partition(":")
            d[k.strip()] = v.strip()
    return int(d.get("run_time_ns", 0)), int(d.get("run_cnt", 0))


def bench_ops(steps: int, reps: int, pairs: int = 7) -> dict:
    """Op-probe overhead on the tiny MLP, interleaved so load drift cancels: one session compiled
    once, then `pairs` rounds of [no probes, our op program on the default op set and on every
    op (in alternating order), an empty program on each of the two offset sets] (the uprobe_multi
    link is created and closed around each measurement). The default set is every
    `at::_ops::*::call` but the view/metadata ops of stacklens.bpf.ops.VIEW_OPS; "all" is
    ProbeConfig(all_ops=True). Ratios are per round (each against its own baseline), reported as
    medians. Hits per step and BPF run time per hit come from the kernel's BPF stats
    (BPF_ENABLE_STATS) while our program runs."""
    from bcc import BPF

    from stacklens.bpf.ops import LIBTORCH_RE, find_op_symbols, select_ops
    from stacklens.bpf.procmaps import find_libraries
    from stacklens.bpf.uprobe_multi import BPF_TRACE_UPROBE_MULTI, attach_uprobe_multi

    t = Target("torch_mlp.py")
    empty = None
    names = ("default", "all")
    try:
        first_base = median_of(t, f"go {steps}", reps)
        s = ProbeSession(t.pid, ProbeConfig(cpu_sample_hz=0, gpu=False))
        t0 = time.perf_counter()
        rep = s.attach()
        attach_s = time.perf_counter() - t0
        with_block = median_of(t, f"go {steps}", reps)  # as attach() leaves it (the old measurement)
        lib = find_libraries(t.pid, LIBTORCH_RE)[0]
        every = find_op_symbols(lib.host_path)
        sets = {n: [o.offset for o in select_ops(every, all_ops=(n == "all"))] for n in names}
        for fd in s._links:  # from here on the benchmark owns the op link
            os.close(fd)
        s._links = []
        empty = BPF(text=b"int sl_empty(struct pt_regs *ctx) { return 0; }")
        empty_fn = empty.load_func(b"sl_empty", BPF.KPROBE, attach_type=BPF_TRACE_UPROBE_MULTI)
        rows = []
        run = {n: [0, 0] for n in names}

        def timed(prog_fd: int, offsets: list[int]) -> float:
            link = attach_uprobe_multi(prog_fd, lib.host_path, offsets, list(range(len(offsets))), pid=t.pid)
            try:
                return median_of(t, f"go {steps}", reps)
            finally:
                os.close(link)

        for k in range(pairs):
            row = {"base": median_of(t, f"go {steps}", reps)}
            for n in (names if k % 2 == 0 else names[::-1]):
                stats_fd = _bpf_stats_fd()
                r0, c0 = _prog_run_stats(s._op_entry.fd)
                row[n] = timed(s._op_entry.fd, sets[n])
                r1, c1 = _prog_run_stats(s._op_entry.fd)
                os.close(stats_fd)
                run[n][0] += r1 - r0
                run[n][1] += c1 - c0
            for n in names:
                row["empty " + n] = timed(empty_fn.fd, sets[n])
            row["load"] = os.getloadavg()[0]
            rows.append(row)
        t0 = time.perf_counter()
        s.detach()
        detach_s = time.perf_counter() - t0
        after = median_of(t, f"go {steps}", reps)
    finally:
        if empty is not None:
            empty.cleanup()
        t.kill()
    base = statistics.median(r["base"] for r in rows)
    out = {"steps": steps, "reps": reps, "pairs": pairs, "baseline_s": base,
           "us_per_step": round(base / steps * 1e6, 1)}
    for n in names:
        hits = run[n][1] / (pairs * reps * steps)
        ratios = [r[n] / r["base"] for r in rows]
        floors = [r["empty " + n] / r["base"] for r in rows]
        per_hit = [(r[n] - r["base"]) / (steps * hits) * 1e9 for r in rows]
        out[n] = {"op_probes": len(sets[n]), "op_calls_per_step": round(hits, 1),
                  "with_op_probes_s": statistics.median(r[n] for r in rows),
                  "ratio": statistics.median(ratios), "ratios": [round(x, 3) for x in ratios],
                  "empty_program_ratio": statistics.median(floors), "empty_ratios": [round(x, 3) for x in floors],
                  "ns_per_hit_total": round(statistics.median(per_hit)),
                  "bpf_run_ns_per_hit": round(run[n][0] / run[n][1]) if run[n][1] else None}
    out.update({"default_session_probes": rep.probes_attached, "block_ratio": with_block / first_base,
                "after_detach_s": after, "after_ratio": after / base,
                "load": [round(r["load"], 1) for r in rows], "attach_s": attach_s, "detach_s": detach_s})
    return out


def bench_events(libdir: Path, launches: int, stacks: bool, fanout: int, rate: int = 0) -> dict:
    """Loader throughput through the default 16 MiB ring: each probe hit submits `fanout` events
    (-DSL_BENCH_FANOUT) because one uprobe hit costs ~16 µs on this VM, so launches alone cannot
    outrun the loader. The run pushes many times the ring's size, so only a loader that keeps up
    has zero drops."""
    t = Target("fake_cuda_bench.py", str(libdir))
    try:
        s = ProbeSession(t.pid, ProbeConfig(cpu_sample_hz=0, ops=False, native_stacks=stacks,
                                            extra_cflags=(f"-DSL_BENCH_FANOUT={fanout}",)))
        s.attach()
        s.poll(0)
        want = launches * fanout
        got = [0]
        last = [0.0]
        stop = threading.Event()

        def drain():
            while not stop.is_set():
                n = len(s.poll(10))
                if n:
                    got[0] += n
                    last[0] = time.perf_counter()

        cpu0 = time.thread_time
        th = threading.Thread(target=drain)
        th.start()
        t0 = time.perf_counter()
        loop_s = run(t, f"paced {launches} {int(1e9 / rate)}" if rate else f"loop {launches}")
        deadline = time.perf_counter() + 30
        while got[0] + s.stats()["drops"] < want and time.perf_counter() < deadline:
            time.sleep(0.05)
        stop.set()
        th.join()
        wall = last[0] - t0
        st = s.stats()
        s.detach()
    finally:
        t.kill()
    del cpu0
    return {"native_stacks": stacks, "fanout": fanout, "target_rate": rate, "events_expected": want, "events_received": got[0],
            "drops": st["drops"], "ring_bytes": 16 << 20, "bytes_through_ring": want * 240,
            "producer_s": round(loop_s, 3), "producer_events_per_s": round(want / loop_s),
            "last_event_after_s": round(wall, 3), "loader_events_per_s": round(got[0] / wall)}


def bench_attach_all(libdir: Path, reps: int) -> dict:
    """Attach/detach everything to a process that maps torch and the fake libcuda."""
    code = ("import ctypes,sys,torch; ctypes.CDLL(sys.argv[1]+'/libcuda.so.1'); print('ready',flush=True); "
            "sys.stdin.readline()")
    script = Path(tempfile.mkdtemp()) / "t.py"
    script.write_text(code)
    out = []
    for _ in range(reps):
        p = subprocess.Popen([sys.executable, str(script), str(libdir)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
        p.stdout.readline()
        s = ProbeSession(p.pid, ProbeConfig(cpu_sample_hz=99))
        t0 = time.perf_counter()
        r = s.attach()
        a = time.perf_counter() - t0
        t0 = time.perf_counter()
        s.detach()
        d = time.perf_counter() - t0
        out.append((a, d, r.probes_attached))
        p.kill()
        p.wait()
    return {"probes": out[0][2], "attach_s": [round(a, 3) for a, _, _ in out],
            "detach_s": [round(d, 4) for _, d, _ in out]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json")
    ap.add_argument("--only", choices=("ops",), help="run one part only (ops: the tiny-MLP op-probe overhead)")
    a = ap.parse_args()
    reps = 3 if a.quick else 5
    libdir = build_fakes(Path(tempfile.mkdtemp()))
    res = {"machine": f"{platform.node()} {platform.release()} {os.cpu_count()} CPUs {platform.processor()}",
           "python": sys.version.split()[0]}
    if a.only == "ops":
        res["ops"] = bench_ops(300 if a.quick else 1000, reps)
        print(json.dumps(res["ops"], indent=1), flush=True)
        if a.json:
            Path(a.json).write_text(json.dumps(res, indent=1))
        return
    res["launch"] = bench_launch(libdir, 100_000 if a.quick else 300_000, reps)
    print(json.dumps(res["launch"], indent=1), flush=True)
    res["pystack"] = bench_pystack_at_probes(libdir, 50_000 if a.quick else 200_000, reps)
    print(json.dumps(res["pystack"], indent=1), flush=True)
    res["ops"] = bench_ops(300 if a.quick else 1000, reps)
    print(json.dumps(res["ops"], indent=1), flush=True)
    secs = 2 if a.quick else 4
    res["events"] = [bench_events(libdir, rate * secs, st, 1, rate)
                     for st in (False, True) for rate in (100_000, 150_000, 200_000, 250_000, 300_000)]
    res["events"].append(bench_events(libdir, 1_000_000, False, 1))  # unpaced: as fast as it goes
    print(json.dumps(res["events"], indent=1), flush=True)
    res["attach_all"] = bench_attach_all(libdir, 3)
    print(json.dumps(res["attach_all"], indent=1), flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
