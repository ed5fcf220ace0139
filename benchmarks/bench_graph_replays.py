"""CUDA-graph replays through the join: cost per replayed kernel and the profile's size over time.

    .venv/bin/python benchmarks/bench_graph_replays.py [--replays 200000] [--repeat 3]

Why (issue 27, acceptance 5): a decode loop replayed as a CUDA graph makes a graph launch and
tens of kernel records per token, for as long as the server runs; splitting each replay per node
(daemon/join/graphs.py) must cost about what charging the replay's kernels to its launch cost, and
the tree must stop growing once every node has its path.

Workload: the backward graph of H200 run 34 (docs/benchmarks/gpu-run34-graphs: 127 kernels, real
names, node ids and durations), replayed `--replays` times from one Python line (a BPF
``cuGraphLaunch`` event, then its kernel records, one correlation id a replay) through
`Joiner(pid, agent=True, join=JoinKind.ORDER)`, `expire()` every 0.2 s of simulated time (what
daemon/session.py does), 500 replays/s of simulated time. Prints µs per replayed kernel for each
repeat, and the tree's node count and traced memory after 10%, 50% and 100% of the replays.

To compare with another version of the code, run this file with that version first on the path
(`PYTHONPATH=/tmp/old`, a `stacklens` copy there).
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import platform
import time
import tracemalloc
from pathlib import Path

from stacklens.cct import Frame
from stacklens.daemon.join.joiner import Joiner
from stacklens.records.agent import AgentStats, JoinKind, KernelRecord
from stacklens.records.events import make_event

RUN34 = Path(__file__).resolve().parents[1] / "docs" / "benchmarks" / "gpu-run34-graphs" / "graph_nodes-inductor.json.gz"
REPLAY_PY = tuple(Frame.python("/srv/app/serve.py", f"f{i}", 10 + i) for i in range(12))


class SimClock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def graph() -> list[tuple[str, int, int]]:
    """(name, node id, duration ns) of the recorded backward graph's first replay, in start order."""
    d = json.load(gzip.open(RUN34))
    first: dict[int, list] = {}
    for corr, gid, node, s, e, _stream, name in d["kernels"]:
        if gid:
            first.setdefault(corr, []).append((s, name, node, e - s))
    big = max(first.values(), key=len)
    return [(n, node, dur) for _s, n, node, dur in sorted(big)]


def run(nodes, replays: int, marks: tuple[float, ...]) -> dict:
    clock = SimClock()
    j = Joiner(1, agent=True, join=JoinKind.ORDER, clock=clock)
    j.on_agent(AgentStats(0, 0.0, 0.0, {}, {"active": 1, "api_records": 0, "enabled_at_ns": 1}))
    step_ns = 2_000_000
    t0 = int(clock.t * 1e9)
    args = {"graph_exec": 0x1000, "stream": 7}
    sizes = []
    want = [int(replays * m) for m in marks]
    busy = 0.0
    last_expire = clock.t
    pc = time.perf_counter
    for r in range(replays):
        t = t0 + r * step_ns
        clock.t = t / 1e9
        ev = make_event("graph", "cuGraphLaunch", 1, 1, t, 0, args, ("aten::replay",), (), REPLAY_PY, "")
        recs = [KernelRecord(name, t + 5_000 + i * 1_000, t + 5_000 + i * 1_000 + dur, 0, 7, r + 1, (1, 1, 1),
                             (1, 1, 1), 8, node) for i, (name, node, dur) in enumerate(nodes)]
        a = pc()
        j.on_bpf(ev)
        for rec in recs:
            j.on_agent(rec)
        if clock.t - last_expire >= 0.2:
            j.expire(t)
            last_expire = clock.t
        busy += pc() - a
        if r + 1 in want:
            snap = j.snapshot()
            sizes.append({"replays": r + 1, "nodes": len(snap.nodes) if hasattr(snap, "nodes") else snap_nodes(snap),
                          "traced_mib": round(tracemalloc.get_traced_memory()[0] / 2**20, 2) if tracemalloc.is_tracing() else None})
    clock.t += 60
    j.expire(int(clock.t * 1e9))
    snap = j.snapshot()
    return {"us_per_kernel": busy / (replays * len(nodes)) * 1e6, "sizes": sizes,
            "gpu_ns": snap.total("gpu_time_ns"), "meta_graphs": snap.meta.get("graphs")}


def snap_nodes(snap) -> int:
    return sum(1 for _ in snap.iter_paths())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--replays", type=int, default=200_000)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--sizes", action="store_true", help="trace memory (slower): the size over the replays")
    a = ap.parse_args()
    nodes = graph()
    print(f"python {platform.python_version()}, {os.cpu_count()} cpus, load {os.getloadavg()[0]:.2f}; "
          f"{len(nodes)} kernels a replay, {a.replays} replays")
    for i in range(a.repeat):
        res = run(nodes, a.replays, ())
        print(f"run {i}: {res['us_per_kernel']:.3f} µs per replayed kernel; graphs {res['meta_graphs']}")
    if a.sizes:
        tracemalloc.start()
        res = run(nodes, a.replays, (0.1, 0.5, 1.0))
        tracemalloc.stop()
        for s in res["sizes"]:
            print(f"after {s['replays']} replays: {s['nodes']} paths, {s['traced_mib']} MiB traced")
        expect = a.replays * sum(d for _n, _id, d in nodes)
        print(f"gpu_time_ns total {res['gpu_ns']} (expected {expect}: {'same' if res['gpu_ns'] == expect else 'DIFFERENT'})")


if __name__ == "__main__":
    main()
