"""How long one ``gc.get_referrers(cls)`` call stops a target's other threads (issue 45).

The agent calls it three ways (docs/agent-in-target.md): the Inductor reader on
``CompiledFxGraph`` (at most every 10 s), the JAX watcher on ``MeshExecutable`` (once per
attach) and the CUDA graph check on ``torch.cuda.CUDAGraph`` (once per detach). It walks every
object the cyclic GC tracks, in C, without letting go of the GIL, so it costs in proportion to the
heap, not to the instances it finds.

Run from the repository root (no privilege; ~1 minute and ~2 GiB of memory for the defaults):
    .venv/bin/python benchmarks/bench_gc_referrers.py [--objects 1000000,3000000] [--kinds instance] [--repeat 5]

Each (kind, size) runs in a fresh interpreter (this file with ``--child``): N GC-tracked objects
held in one list, 8 instances of a target class, then ``--repeat`` timed calls of
``gc.get_referrers(Target)``. Kinds: ``instance`` (a small class with one attribute, like most
objects of a real heap), ``slots`` (the same with ``__slots__``), ``list`` (empty lists). A second
thread spins on ``time.perf_counter()`` meanwhile; its longest gap during a call is how long it
could not run. Also the heap's size as ``sys.getallocatedblocks()`` says it, and what asking
costs: the agent skips a walk where it is over ``heapscan.MAX_SCAN_BLOCKS``. Prints one Markdown
row per (kind, size).
"""

from __future__ import annotations

import argparse
import gc
import statistics
import subprocess
import sys
import threading
import time


class Target:
    """Stands for CompiledFxGraph / MeshExecutable / CUDAGraph: a class with a few instances."""


class Filler:
    def __init__(self, i):
        self.x = i


class SlotFiller:
    __slots__ = ("x",)

    def __init__(self, i):
        self.x = i


KINDS = {"instance": Filler, "slots": SlotFiller, "list": lambda i: []}


def _child(kind: str, n: int, repeat: int) -> str:
    make = KINDS[kind]
    heap = [make(i) for i in range(n)]
    targets = [Target() for _ in range(8)]
    tracked = len(gc.get_objects())
    t0 = time.perf_counter()
    blocks = sys.getallocatedblocks()      # the agent's bound (inject/agent/heapscan.py) reads this
    blocks_ms = (time.perf_counter() - t0) * 1e3
    gaps: list[float] = []
    running = True
    window: list[float] = []          # [start, end] of the call being timed, read by the spinner

    def spin():
        last = time.perf_counter()
        while running:
            now = time.perf_counter()
            if window and window[0] <= now:
                gaps.append(now - last)
            last = now

    t = threading.Thread(target=spin, daemon=True)
    t.start()
    time.sleep(0.05)
    calls, stalls = [], []
    for _ in range(repeat):
        gaps.clear()
        window[:] = [time.perf_counter()]
        t0 = time.perf_counter()
        found = [o for o in gc.get_referrers(Target) if type(o) is Target]
        calls.append(time.perf_counter() - t0)
        time.sleep(0.02)                  # the spinner records the gap that spans the call
        window.clear()
        stalls.append(max(gaps, default=0.0))
        assert len(found) == len(targets)
        del found
        time.sleep(0.05)
    running = False
    t.join()
    del heap
    ms = [c * 1e3 for c in calls]
    return (f"| {kind} | {n:,} | {tracked:,} | {blocks:,} | {blocks_ms:.2f} | {min(ms):.1f} | "
            f"{statistics.median(ms):.1f} | {max(ms):.1f} | {max(stalls) * 1e3:.1f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--objects", default="1000000,3000000", help="comma-separated heap sizes")
    ap.add_argument("--kinds", default="instance", help=f"comma-separated, of {', '.join(KINDS)}")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--child", nargs=2, help=argparse.SUPPRESS)     # KIND N
    a = ap.parse_args()
    if a.child is not None:
        print(_child(a.child[0], int(a.child[1]), a.repeat))
        return
    print(f"Python {sys.version.split()[0]}, {sys.executable}")
    print("| kind | objects made | GC-tracked objects | allocated blocks | getallocatedblocks() ms "
          "| get_referrers ms: min | median | max | longest stall of a spinning thread, ms |")
    print("|---|---|---|---|---|---|---|---|---|")
    for kind in a.kinds.split(","):
        for n in a.objects.split(","):
            out = subprocess.run([sys.executable, __file__, "--child", kind, n, "--repeat", str(a.repeat)],
                                 capture_output=True, text=True, check=True)
            print(out.stdout.strip(), flush=True)


if __name__ == "__main__":
    main()
