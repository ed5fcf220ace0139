"""Target: spends ~70% of its time in f and ~30% in g (pure Python, no I/O). argv[1] = stop file.

Periods are long (70 ms / 30 ms) so the sampler's view is not skewed by the GIL hand-over at
phase edges; at exit it prints the split it really had (`split F_SECONDS G_SECONDS`), which is
the ground truth the test compares against on a loaded machine.
"""
import os
import sys
import time


def spin(seconds):
    end = time.perf_counter() + seconds
    x = 0
    while time.perf_counter() < end:
        x += 1
    return x


SPENT = {"f": 0.0, "g": 0.0}


def f():
    t = time.perf_counter()
    spin(0.070)
    SPENT["f"] += time.perf_counter() - t


def g():
    t = time.perf_counter()
    spin(0.030)
    SPENT["g"] += time.perf_counter() - t


def main():
    stop = sys.argv[1]
    print("ready", flush=True)
    n = 0
    while True:
        f()
        g()
        n += 1
        if os.path.exists(stop):
            break
    print(f"split {SPENT['f']:.6f} {SPENT['g']:.6f}", flush=True)
    print("done", flush=True)


if __name__ == "__main__":
    main()
