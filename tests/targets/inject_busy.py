"""Target: a busy pure-Python loop. argv[1] = stop file. Prints ready, then a fixed result."""
import os
import sys


def work():
    acc = 0
    for i in range(2000):
        acc = (acc * 31 + i * i) % 1_000_003
    return acc


def main():
    stop = sys.argv[1]
    expected = work()
    print("ready", flush=True)
    bad = 0
    n = 0
    while True:
        if work() != expected:
            bad += 1
        n += 1
        if n % 20 == 0 and os.path.exists(stop):
            break
    print(f"result={expected} mismatches={bad}", flush=True)


if __name__ == "__main__":
    main()
