"""Target: a busy loop that releases the GIL every few ms (a stat call) and records the GIL switch
intervals it sees. argv[1] = stop file. Prints ready, then every interval seen and the final one."""
import os
import sys


def work():
    acc = 0
    for i in range(2000):
        acc = (acc * 31 + i * i) % 1_000_003
    return acc


def main():
    stop = sys.argv[1]
    print("ready", flush=True)
    seen = set()
    n = 0
    while True:
        work()
        seen.add(sys.getswitchinterval())
        n += 1
        if n % 20 == 0 and os.path.exists(stop):
            break
    print("seen=" + ",".join(f"{s:.6f}" for s in sorted(seen)), flush=True)
    print(f"final={sys.getswitchinterval():.6f}", flush=True)


if __name__ == "__main__":
    main()
