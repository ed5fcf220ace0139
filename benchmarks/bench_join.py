"""Joiner benchmark: the daemon's per-event cost for a launch + its CUPTI kernel record (order join).

    .venv/bin/python benchmarks/bench_join.py [--launches 100000] [--paths 300] [--repeat 3]

Why (issue 9): a ViT inference job on the H200 makes ~25k kernel launches/s; the daemon's one
aggregation thread gets a BPF launch event and a CUPTI kernel record for each, and fell behind.
This replays that load through `Joiner(pid, agent=True, join=JoinKind.ORDER)` (daemon/join/orderjoin.py)
the way the session loop feeds it, and reports µs per launch+kernel pair.

Workload (all built before the timed region; events are real `bpf.events.Event` tuples with the
arguments already decoded to a dict):
- `--paths` distinct launch contexts, each 30 Python frames (a shared 20-frame prefix, then a
  per-layer tail), 2 operators, 10 native frames (libtorch_python → libtorch_cuda → libcudart);
  the stack tuples are the same objects for the same context, as the probe session hands them
  out. Launches cycle through the contexts in a fixed "forward pass" order at `--rate` launches/s
  of simulated time, each with its grid/block; a context's kernel name comes from BPF
  (`--bpf-names resolved`), is empty (`empty`: the kernel frame comes from CUPTI) or is an
  unresolved handle (`unresolved`).
- CUPTI kernel records, correlation ids stepping by one per launch, arrive in buffers every
  `--buffer-ms` of simulated time after their launch; within a buffer `--disorder` of the records
  are swapped with a neighbour (two streams).
- The loop: per `--batch` launches, `on_bpf` for each, `on_agent` for the records whose buffer has
  arrived, `expire()` every 0.2 s of simulated time (what daemon/session.py does); with
  `--flush batch`, also `Joiner.flush()` (if the code has one) at the end of every batch; at the
  end, simulated time moves past SETTLE_NS and `expire()` joins the rest. The simulated clock
  drives the window buckets (1 s) and the order join's settle time.

To compare with another version of the code, run this file with that version first on the path
(e.g. `PYTHONPATH=/tmp/old` holding a `stacklens` copy): the digests must match.

Prints per phase (on_bpf, on_agent, flush, expire/drain) µs per pair, the total µs per pair for
each repeat, and a digest of the final snapshot (every path's values) so runs of two versions
of the code can be checked for the same result.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import platform
import random
import time

from stacklens.records.events import make_event
from stacklens.cct import Frame
from stacklens.daemon.join.joiner import Joiner
from stacklens.records.agent import JoinKind
from stacklens.daemon.join.orderjoin import SETTLE_NS
from stacklens.records.agent import AgentStats, KernelRecord

OPS = (("aten::linear", "aten::addmm"), ("aten::gelu", "aten::gelu"), ("aten::layer_norm", "aten::native_layer_norm"),
       ("aten::scaled_dot_product_attention", "aten::_flash_attention_forward"), ("aten::add", "aten::add"))


class SimClock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def make_contexts(n: int, bpf_names: str, rng: random.Random) -> list[tuple]:
    """(py_stack, op_path, native_stack, kernel_name, args, cupti_name) per distinct launch context."""
    prefix = tuple(Frame.python(f"/opt/venv/lib/python3.11/site-packages/timm/m{i}.py", f"f{i}", 10 + i)
                   for i in range(20))
    native_base = (Frame.native("/opt/venv/lib/python3.11/site-packages/torch/lib/libtorch_python.so",
                                "torch::autograd::THPVariable_linear"),
                   Frame.native("/opt/venv/lib/python3.11/site-packages/torch/lib/libtorch_cpu.so",
                                "at::_ops::linear::call"))
    ctxs = []
    for c in range(n):
        layer, kind = divmod(c, len(OPS))
        tail = tuple(Frame.python(f"/opt/venv/lib/python3.11/site-packages/timm/vit{j}.py", f"block{j}_{layer}",
                                  100 + j * 7 + kind) for j in range(10))
        py = prefix + tail
        ops = OPS[kind]
        nat = native_base + tuple(Frame.native("/opt/venv/lib/python3.11/site-packages/torch/lib/libtorch_cuda.so",
                                               f"at::native::impl{kind}_{k}") for k in range(6)) + (
            Frame.native("/usr/local/cuda/lib64/libcudart.so.12", "cudaLaunchKernel"),
            Frame.native("/usr/lib/x86_64-linux-gnu/libcuda.so.1", "cuLaunchKernel"))
        cupti = f"void at::native::vectorized_elementwise_kernel<4, k{c % 97}>(int)"
        name = {"resolved": cupti, "empty": "", "unresolved": f"unresolved:0x{0x7f0000 + c % 97:x}"}[bpf_names]
        args = dict(grid_x=rng.choice((8, 64, 264, 1024)), grid_y=rng.choice((1, 1, 12)), grid_z=1,
                    block_x=rng.choice((128, 256, 512)), block_y=1, block_z=1, shared_mem=0, stream=7)
        ctxs.append((py, ops, nat, name, args, cupti))
    return ctxs


def make_workload(args: argparse.Namespace):
    rng = random.Random(args.seed)
    ctxs = make_contexts(args.paths, args.bpf_names, rng)
    order = list(range(len(ctxs)))
    step_ns = int(1e9 / args.rate)
    t0 = int(SimClock().t * 1e9)
    launches = []
    kernels = []
    for i in range(args.launches):
        py, ops, nat, name, a, cupti = ctxs[order[i % len(order)]]
        t = t0 + i * step_ns
        launches.append(make_event("launch", "cuLaunchKernel", 1, 1, t, 0, a, ops, nat, py, name))
        kernels.append(KernelRecord(cupti, t + 5_000, t + 5_000 + 20_000, 0, 7, i + 1,
                                    (a["grid_x"], a["grid_y"], a["grid_z"]), (a["block_x"], a["block_y"], a["block_z"]),
                                    0))
    # CUPTI buffers: the records of launches in [k*buf, (k+1)*buf) arrive at (k+2)*buf, some swapped
    buf_ns = int(args.buffer_ms * 1e6)
    arrivals: list[tuple[int, list]] = []
    for k in range(0, args.launches, max(1, buf_ns // step_ns)):
        chunk = kernels[k:k + max(1, buf_ns // step_ns)]
        for j in range(len(chunk) - 1):
            if rng.random() < args.disorder:
                chunk[j], chunk[j + 1] = chunk[j + 1], chunk[j]
        arrivals.append((t0 + k * step_ns + 2 * buf_ns, chunk))
    return launches, arrivals, step_ns


def digest(snap) -> str:
    """Every non-root path with a value, as (frame labels, exclusive values in metric order), sorted."""
    h = hashlib.sha256()
    rows = [(tuple(f.label() for f in path), tuple(values.values())) for path, values in snap.iter_paths() if path]
    for r in sorted(rows):
        h.update(repr(r).encode())
    return h.hexdigest()[:16]


def run_once(launches, arrivals, step_ns: int, batch: int, flush_each_batch: bool = False) -> dict:
    clock = SimClock()
    j = Joiner(1, agent=True, join=JoinKind.ORDER, clock=clock)
    j.on_agent(AgentStats(0, 0.0, 0.0, {}, {"active": 1, "api_records": 0, "enabled_at_ns": 1}))
    flush = getattr(j, "flush", None) if flush_each_batch else None
    on_bpf, on_agent, expire = j.on_bpf, j.on_agent, j.expire
    pc = time.perf_counter
    t_bpf = t_agent = t_flush = t_expire = 0.0
    ai = 0
    last_expire = clock.t
    n = len(launches)
    for b in range(0, n, batch):
        evs = launches[b:b + batch]
        clock.t = evs[-1].ktime_ns / 1e9
        now_ns = evs[-1].ktime_ns
        t = pc()
        for ev in evs:
            on_bpf(ev)
        t_bpf += pc() - t
        recs = []
        while ai < len(arrivals) and arrivals[ai][0] <= now_ns:
            recs.extend(arrivals[ai][1])
            ai += 1
        t = pc()
        for rec in recs:
            on_agent(rec)
        t_agent += pc() - t
        if flush is not None:
            t = pc()
            flush()
            t_flush += pc() - t
        if clock.t - last_expire > 0.2:
            last_expire = clock.t
            t = pc()
            expire(now_ns)
            t_expire += pc() - t
    # the rest of the records arrive, then everything settles
    recs = [r for _, chunk in arrivals[ai:] for r in chunk]
    t = pc()
    for rec in recs:
        on_agent(rec)
    t_agent += pc() - t
    clock.t += SETTLE_NS / 1e9 + 1
    t = pc()
    expire(int(clock.t * 1e9))
    t_expire += pc() - t
    snap = j.snapshot()
    assert j.stats.kernels_joined == n, (j.stats.kernels_joined, n)
    assert snap.total("launch_count") == n and snap.total("kernel_count") == n
    per = 1e6 / n
    return {"bpf": t_bpf * per, "agent": t_agent * per, "flush": t_flush * per, "expire": t_expire * per,
            "total": (t_bpf + t_agent + t_flush + t_expire) * per, "digest": digest(snap),
            "extra": dict(j.stats.extra)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--launches", type=int, default=100_000)
    p.add_argument("--paths", type=int, default=300, help="distinct launch contexts")
    p.add_argument("--rate", type=float, default=25_000, help="launches per second of simulated time")
    p.add_argument("--batch", type=int, default=512, help="BPF events per session-loop batch")
    p.add_argument("--buffer-ms", type=float, default=250.0, help="CUPTI buffer period (simulated)")
    p.add_argument("--disorder", type=float, default=0.05, help="share of kernel records swapped with a neighbour")
    p.add_argument("--bpf-names", choices=("resolved", "empty", "unresolved"), default="resolved")
    p.add_argument("--flush", choices=("expire", "batch"), default="expire",
                   help="when staged counts are applied: at expire() only (the session today), or every batch too")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--seed", type=int, default=1)
    args = p.parse_args()
    launches, arrivals, step_ns = make_workload(args)
    print(f"python {platform.python_version()}, {os.cpu_count()} cpus, load {os.getloadavg()[0]:.2f}; "
          f"{args.launches} launches over {args.paths} contexts, bpf names {args.bpf_names}, "
          f"disorder {args.disorder}, batch {args.batch}, flush at {args.flush}")
    totals = []
    for r in range(args.repeat):
        res = run_once(launches, arrivals, step_ns, args.batch, args.flush == "batch")
        totals.append(res["total"])
        print(f"run {r + 1}: {res['total']:.2f} us/pair  (on_bpf {res['bpf']:.2f}, on_agent {res['agent']:.2f}, "
              f"flush {res['flush']:.2f}, expire/drain {res['expire']:.2f})  digest {res['digest']}")
    print(f"best {min(totals):.2f} us/pair, median {sorted(totals)[len(totals) // 2]:.2f}; "
          f"order stats {res['extra']}")


if __name__ == "__main__":
    main()
