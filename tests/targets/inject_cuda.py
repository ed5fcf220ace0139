"""GPU target: a torch CUDA job driven through stdin, for the CUPTI collector test and benchmark.

Commands (one per line): "seq" runs the known sequence (N_ADD add_ kernels + N_MM matmuls) and
prints "done"; "prof" runs the same sequence under torch.profiler and prints "prof <json>" with
{kernel name: [count, mean_ns]}; "bench N" runs N launch-bound steps and prints "bench <us/step>";
"quit" exits.
"""
import json
import os
import sys
import time

import torch

N_ADD, N_MM = 200, 50


def sequence(x, w):
    for _ in range(N_ADD):
        x.add_(1.0)
    for _ in range(N_MM):
        torch.mm(w, w)
    torch.cuda.synchronize()


def bench(x, steps):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        x.add_(1.0)
        x.mul_(0.5)
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / steps * 1e6


def stdin_lines():
    """Lines of stdin, waiting in short select() slices: a thread blocked in read() never runs
    Python, so an injected agent's bootstrap would never start (the injector says so)."""
    import select

    buf = b""
    fd = sys.stdin.fileno()
    while True:
        ready, _, _ = select.select([fd], [], [], 0.05)
        if not ready:
            continue
        chunk = os.read(fd, 4096)
        if not chunk:
            return
        buf += chunk
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            yield line.decode()


def main():
    x = torch.zeros(1 << 20, device="cuda")
    w = torch.randn(1024, 1024, device="cuda")
    sequence(x, w)       # warm up (cuBLAS handles, allocator)
    print("ready", flush=True)
    for line in stdin_lines():
        cmd = line.split()
        if not cmd:
            continue
        if cmd[0] == "seq":
            sequence(x, w)
            print("done", flush=True)
        elif cmd[0] == "prof":
            from torch.profiler import ProfilerActivity, profile
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                sequence(x, w)
            stats = {}
            for e in prof.events():
                if e.device_type.name == "CUDA":
                    c, tot = stats.get(e.name, (0, 0))
                    stats[e.name] = (c + 1, tot + e.device_time * 1000)
            print("prof " + json.dumps({k: [c, t / c] for k, (c, t) in stats.items()}), flush=True)
        elif cmd[0] == "bench":
            print(f"bench {bench(x, int(cmd[1])):.3f}", flush=True)
        elif cmd[0] == "quit":
            break


if __name__ == "__main__":
    main()
