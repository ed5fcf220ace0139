"""Cost of the in-BPF Python stack walk per probe hit, and the symbolization cache hit rate.

Needs root + eBPF. One target process (tests/targets/py_bench.py) runs `os.getpid()` in a tight
loop at a chosen Python depth; a uprobe on libc getpid runs one of several builds of
bpf/programs/pystack_test.bpf.c, attached and detached in round-robin so that every variant is
measured in the same run, interleaved:

  none          no probe
  nowalk        uprobe, count only (baseline probe cost)
  walk          uprobe, TLS tstate lookup + walk into per-CPU scratch, count
  walk_notag    same without the per-frame code tag read (-DSL_PY_NO_TAG)
  walk_map      tstate from a tid map filled by user space instead of TLS
  ring_nowalk   uprobe, ring buffer record without stack (consumer drains)
  ring_walk     uprobe, ring buffer record with the stack (consumer drains)

Then a mixed workload (40 generated functions, depths 2-10, two threads) runs for
--mix-seconds with `ring_walk`, and every event is symbolized: cache hit rate, µs per event.

    sudo .venv/bin/python benchmarks/bench_pystack.py [--python PATH] [--json OUT]
"""

from __future__ import annotations

import argparse
import ctypes as ct
import json
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

from bcc import BPF  # noqa: E402

from stacklens.pystacks.pysym import RawPyStack  # noqa: E402
from stacklens.pystacks.python_process import PythonStackReader  # noqa: E402

PROGRAM = ROOT / "bpf" / "programs" / "pystack_test.bpf.c"
TARGET = ROOT / "tests" / "targets" / "py_bench.py"
VARIANTS = {
    "nowalk": ["-DPT_COUNT_ONLY", "-DPT_NO_WALK"],
    "walk": ["-DPT_COUNT_ONLY"],
    "walk_notag": ["-DPT_COUNT_ONLY", "-DSL_PY_NO_TAG"],
    "walk_map": ["-DPT_COUNT_ONLY", "-DPT_THREAD_MAP"],
    "ring_nowalk": ["-DPT_NO_WALK"],
    "ring_walk": [],
}


def libc_of(pid: int) -> str:
    path = next(line.split()[-1] for line in open(f"/proc/{pid}/maps") if "/libc.so" in line)
    root = os.path.realpath(f"/proc/{pid}/root")
    return path[len(root):] if root != "/" and path.startswith(root + "/") else path


class Target:
    def __init__(self, python: str):
        self.p = subprocess.Popen([python, str(TARGET)], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, text=True)
        assert self.p.stdout.readline().strip() == "ready"

    def ask(self, line: str) -> float:
        self.p.stdin.write(line + "\n")
        self.p.stdin.flush()
        return float(self.p.stdout.readline())

    def close(self):
        self.p.stdin.write("quit\n")
        self.p.stdin.flush()
        self.p.wait(10)


class Drain:
    """Polls a ring buffer on a thread while the target runs."""

    def __init__(self, b: BPF, reader: PythonStackReader, symbolize: bool = False):
        self.b, self.reader, self.symbolize = b, reader, symbolize
        self.events, self.sym_ns = 0, 0
        st = reader.struct_type()

        class Ev(ct.Structure):
            _fields_ = [("tid", ct.c_uint32), ("pad", ct.c_uint32), ("ktime", ct.c_uint64),
                        ("st", st)]

        def cb(_ctx, data, _size):
            self.events += 1
            if self.symbolize:
                e = ct.cast(data, ct.POINTER(Ev)).contents
                t0 = time.perf_counter_ns()
                reader.symbolize(RawPyStack.from_struct(e.st))
                self.sym_ns += time.perf_counter_ns() - t0

        b[b"pt_events"].open_ring_buffer(cb)

    def start(self):
        self.stop = threading.Event()
        self.t = threading.Thread(target=self._run, daemon=True)
        self.t.start()
        return self

    def _run(self):
        while not self.stop.is_set():
            self.b.ring_buffer_poll(50)

    def close(self):
        self.stop.set()
        self.t.join()
        self.b.ring_buffer_consume()


def counts(b: BPF) -> dict:
    c = b[b"pt_counts"]
    keys = ("hits", "drops", "frames", "errors", "fill_ns")
    return {k: sum(c[ct.c_int(i)]) for i, k in enumerate(keys)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--python", default=sys.executable, help="interpreter of the target (default: this one)")
    ap.add_argument("--calls", type=int, default=100_000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--depths", default="5,30")
    ap.add_argument("--mix-seconds", type=float, default=60.0)
    ap.add_argument("--json")
    args = ap.parse_args()

    tgt = Target(args.python)
    reader = PythonStackReader(tgt.p.pid)
    libc = libc_of(tgt.p.pid).encode()
    progs = {}
    for name, extra in VARIANTS.items():
        progs[name] = BPF(src_file=str(PROGRAM).encode(),
                          cflags=reader.cflags() + extra + ["-DPT_RING_PAGES=4096"])
    reader.populate(progs["walk_map"])
    drains = {v: Drain(progs[v], reader) for v in VARIANTS if v.startswith("ring")}
    depths = [int(d) for d in args.depths.split(",")]
    samples: dict = {(v, d): [] for d in depths for v in ["none", *VARIANTS]}
    frames: dict = {}
    fill_ns: dict = {}
    for _ in range(args.rounds):
        for d in depths:
            for v in ["none", *VARIANTS]:
                b = progs.get(v)
                drain = None
                if b is not None:
                    before = counts(b)
                    b.attach_uprobe(name=libc, sym=b"getpid", fn_name=b"pt_probe", pid=tgt.p.pid)
                    if v.startswith("ring"):
                        drain = drains[v].start()
                ns = tgt.ask(f"run {args.calls} {d}")
                if b is not None:
                    if drain:
                        drain.close()
                    b.detach_uprobe(name=libc, sym=b"getpid", pid=tgt.p.pid)
                    after = counts(b)
                    hits = after["hits"] - before["hits"]
                    frames[(v, d)] = (after["frames"] - before["frames"]) / max(hits, 1)
                    fill_ns.setdefault((v, d), []).append(
                        (after["fill_ns"] - before["fill_ns"]) / max(hits, 1))
                    if after["drops"] != before["drops"]:
                        print(f"warning: {v} depth {d}: ring buffer drops", file=sys.stderr)
                samples[(v, d)].append(ns)
    result = {"python": args.python, "version": "%d.%d" % reader.interpreter.version,
              "mode": reader.mode, "calls_per_run": args.calls, "rounds": args.rounds,
              "machine": f"{platform.node()} {platform.machine()} {os.cpu_count()} CPUs, "
                         f"kernel {platform.release()}",
              "per_call_ns": {}, "added_walk_ns": {}}
    for d in depths:
        med = {v: statistics.median(samples[(v, d)]) for v in ["none", *VARIANTS]}
        result["per_call_ns"][d] = {v: round(x, 1) for v, x in med.items()}
        result["added_walk_ns"][d] = {
            "walk": round(med["walk"] - med["nowalk"], 1),
            "walk_notag": round(med["walk_notag"] - med["nowalk"], 1),
            "walk_map": round(med["walk_map"] - med["nowalk"], 1),
            "ring_walk": round(med["ring_walk"] - med["ring_nowalk"], 1),
            "frames_per_hit": round(frames.get(("walk", d), 0), 1),
        }
        # measured inside the probe with bpf_ktime_get_ns around the walk (count-only builds)
        result.setdefault("in_bpf_fill_ns", {})[d] = {
            v: round(statistics.median(fill_ns[(v, d)]), 1)
            for v in ("nowalk", "walk", "walk_notag", "walk_map")}

    if args.mix_seconds > 0:
        b = progs["ring_walk"]
        reader.symbolizer.stats.__init__()
        before = counts(b)
        b.attach_uprobe(name=libc, sym=b"getpid", fn_name=b"pt_probe", pid=tgt.p.pid)
        drain = drains["ring_walk"]
        drain.events, drain.symbolize = 0, True
        drain.start()
        calls = tgt.ask(f"mix {args.mix_seconds}")
        drain.close()
        b.detach_uprobe(name=libc, sym=b"getpid", pid=tgt.p.pid)
        after = counts(b)
        s = reader.symbolizer.stats
        result["mix"] = {
            "seconds": args.mix_seconds, "calls": int(calls), "events": drain.events,
            "ring_drops": after["drops"] - before["drops"],
            "frames_symbolized": s.hits + s.misses + s.stale + s.errors,
            "cache_hits": s.hits, "cache_misses": s.misses, "stale": s.stale,
            "errors": s.errors, "hit_rate": round(s.hit_rate(), 6),
            "symbolize_us_per_event": round(drain.sym_ns / max(drain.events, 1) / 1000, 2),
        }
    tgt.close()
    text = json.dumps(result, indent=2)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")


if __name__ == "__main__":
    main()
