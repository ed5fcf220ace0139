"""Benchmark: analyze() on a 100,000-node snapshot shaped like a real GPU training profile.

    .venv/bin/python benchmarks/bench_analyzer.py [--nodes 100000] [--repeat 5]

The tree: 200 Python call sites × nested Python frames → op → nested ops → native → launch API →
kernels, with every metric populated (so every rule has work), padded with distinct CPU-sample
leaves up to --nodes. Reports the best and median wall time of a cold analyze() (a fresh
snapshot each time, so the shared per-snapshot view is rebuilt) and of the view build alone.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time

from stacklens.analyzer import analyze
from stacklens.analyzer.view import View
from stacklens.cct import CCT, METRICS, Frame

KERNELS = ["ampere_sgemm_128x64_nn", "vectorized_elementwise_kernel<4, CUDAFunctor_add<float>>",
           "reduce_kernel<512, 1>", "direct_copy_kernel_cuda", "cutlass_80_tensorop_s1688gemm_128x128"]
OPS = ["aten::addmm", "aten::add_Tensor", "aten::sum", "aten::contiguous", "aten::item", "aten::zeros",
       "aten::_to_copy", "autograd::engine::evaluate_function: MmBackward0"]


def build(nodes: int):
    t = CCT(METRICS + ("py_samples",), max_nodes=nodes + 10)
    main = Frame.python("train.py", "main", 100)
    i = 0
    while t.node_count < nodes:
        site = Frame.python(f"model/layer{i % 200}.py", f"forward{i % 37}", 10 + i % 400)
        inner = Frame.python("torch/nn/modules/module.py", "_call_impl", 1789)
        op = Frame.op(OPS[i % len(OPS)])
        sub = Frame.op(OPS[(i * 7) % len(OPS)])
        nat = Frame.native("libtorch_cuda.so", f"at::native::kernel_{i % 5000}")
        base = (main, site, inner, op, sub, nat)
        if i % 3 == 0:
            api = Frame.api("cuLaunchKernel")
            t.add_many(base + (api,), {"api_cpu_ns": 4000})
            t.add_many(base + (api, Frame.kernel(KERNELS[i % len(KERNELS)])),
                       {"gpu_time_ns": 9000 + i % 100_000, "kernel_count": 1, "launch_count": 1})
        elif i % 3 == 1:
            t.add_many(base + (Frame.api("cuStreamSynchronize"),), {"sync_wait_ns": 50_000, "api_cpu_ns": 2000})
            t.add_many(base, {"alloc_bytes": 1 << 20, "cpu_samples": 3})
        else:
            t.add_many(base + (Frame.native("libc.so.6", f"leaf_{i}"),), {"cpu_samples": 1 + i % 7, "py_samples": 1})
        i += 1
    return t


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--nodes", type=int, default=100_000)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    tree = build(args.nodes)
    snaps = [tree.snapshot(meta={"duration_s": 10.0}) for _ in range(args.repeat)]
    print(f"snapshot: {snaps[0].node_count} nodes, folded {snaps[0].folded_nodes}")
    view_t, full_t, n_found = [], [], 0
    for s in snaps:
        t0 = time.perf_counter()
        View(s)
        view_t.append(time.perf_counter() - t0)
    for s in snaps:  # fresh snapshots: the view cache never hits across iterations
        t0 = time.perf_counter()
        n_found = len(analyze(s))
        full_t.append(time.perf_counter() - t0)
    print(f"view build: best {min(view_t) * 1e3:.0f} ms, median {statistics.median(view_t) * 1e3:.0f} ms")
    print(f"analyze():  best {min(full_t) * 1e3:.0f} ms, median {statistics.median(full_t) * 1e3:.0f} ms "
          f"({n_found} findings, 9 rules)")
    print(f"python {sys.version.split()[0]}, {platform.machine()}, {platform.processor() or platform.platform()}")


if __name__ == "__main__":
    main()
