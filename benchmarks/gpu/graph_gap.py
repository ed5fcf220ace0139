"""What a CUDA graph leaves between kernels (issue 29: the launch-bound finding's estimate).

    python benchmarks/gpu/graph_gap.py --out DIR        (the GPU machine; ~1 minute)

A chain of N small dependent elementwise kernels (sizes like batch-1 decoding's), run eagerly and
replayed from a CUDA graph; per kernel: the wall time of each, and the kernels' own GPU time from
torch.profiler (CUPTI). The graph's gap per kernel = replay wall time / N - mean kernel time: what
the launch-bound rule adds back per launch when it estimates the step with graphs.
Writes DIR/graph_gap.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch


def chain(x: torch.Tensor, n: int) -> torch.Tensor:
    for _ in range(n):
        x = torch.tanh(x)          # one kernel each, dependent on the last
    return x


def timed(fn, reps: int) -> float:
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / reps


def kernel_mean_us(fn) -> float:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as p:
        fn()
        torch.cuda.synchronize()
    durs = [getattr(e, "device_time", None) or e.cuda_time for e in p.events()
            if e.device_type == torch.autograd.DeviceType.CUDA]
    return statistics.mean(durs)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--kernels", type=int, default=500)
    ap.add_argument("--reps", type=int, default=40)
    a = ap.parse_args()
    rows = []
    for width in (768, 768 * 4, 768 * 64):
        x = torch.randn(1, width, device="cuda")
        for _ in range(3):
            chain(x, a.kernels)
        eager = timed(lambda: chain(x, a.kernels), a.reps)
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(3):
                chain(x, a.kernels)
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            chain(x, a.kernels)
        for _ in range(3):
            g.replay()
        replay = timed(g.replay, a.reps)
        k_us = kernel_mean_us(lambda: chain(x, a.kernels))
        row = {"width": width, "kernels": a.kernels, "eager_us_per_kernel": round(eager / a.kernels * 1e6, 3),
               "graph_us_per_kernel": round(replay / a.kernels * 1e6, 3), "kernel_mean_us": round(k_us, 3),
               "graph_gap_us": round(replay / a.kernels * 1e6 - k_us, 3),
               "eager_gap_us": round(eager / a.kernels * 1e6 - k_us, 3)}
        rows.append(row)
        print(json.dumps(row), flush=True)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "graph_gap.json").write_text(json.dumps({"device": torch.cuda.get_device_name(),
                                                    "torch": torch.__version__, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
