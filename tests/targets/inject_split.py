"""Target: spends ~70% of its time in f and ~30% in g (pure Python, no I/O). argv[1] = stop file."""
import os
import sys
import time


def spin(seconds):
    end = time.perf_counter() + seconds
    x = 0
    while time.perf_counter() < end:
        x += 1
    return x


def f():
    return spin(0.007)


def g():
    return spin(0.003)


def main():
    stop = sys.argv[1]
    print("ready", flush=True)
    n = 0
    while True:
        f()
        g()
        n += 1
        if n % 10 == 0 and os.path.exists(stop):
            break
    print("done", flush=True)


if __name__ == "__main__":
    main()
