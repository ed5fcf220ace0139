"""Benchmark target: runs a fixed unit of work in a loop and prints, every 0.5 s,
"rate <monotonic_ns> <units per second> <units per main-thread CPU second>". argv[1]: "python" (pure-Python work) or "torch"."""
import sys
import time


def py_unit():
    acc = 0
    for i in range(2000):
        acc = (acc * 31 + i * i) % 1_000_003
    return acc


def main():
    kind = sys.argv[1] if len(sys.argv) > 1 else "python"
    if kind == "torch":
        import torch
        torch.set_num_threads(1)
        a = torch.randn(128, 128)

        def unit():
            return (a @ a).sum().item()
    else:
        unit = py_unit
    print("ready", flush=True)
    t0, c0, n = time.monotonic(), time.thread_time(), 0
    while True:
        unit()
        n += 1
        t = time.monotonic()
        if t - t0 >= 0.5:
            c = time.thread_time()
            print(f"rate {time.monotonic_ns()} {n / (t - t0):.1f} {n / max(c - c0, 1e-9):.1f}", flush=True)
            t0, c0, n = t, c, 0


if __name__ == "__main__":
    main()
