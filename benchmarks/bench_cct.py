"""CCT insertion benchmark: events/s, peak tree memory, memory vs run length, cost vs a dict.

    .venv/bin/python benchmarks/bench_cct.py [--events 1000000] [--contexts 10000] [--depth 20]

Workload: `--contexts` distinct `--depth`-frame paths that share prefixes the way stacks do
(each new path copies a random prefix of an earlier one and continues with new frames), and a
pre-generated stream of `--events` (path, metric, value) events drawn from them. Paths in the
stream are the same tuple objects over and over, as a plain dict counter's best case.

Reports (results recorded in docs/benchmarks/cct.md):
- events/s of `CCT.add` and of a plain dict counter `d[path] = d.get(path, 0) + value` over
  the same stream in the same process, and their ratio (acceptance: at most 3x);
- peak traced memory while inserting (tracemalloc; the frames themselves were allocated
  before tracing starts, as they belong to the events) and the tree's memory after 1x and 10x
  the stream (acceptance: within 5%, memory must not grow with run length);
- the time to take a snapshot of the resulting tree;
- events/s when the tree cannot hold every context (`--small-cap`, default 25,000 nodes for the
  55,159 the workload needs), where contexts are turned away into `[other]` and folded: for the
  uniform stream (the worst case: every context equally hot) and for a Zipf(1.1) stream.
"""

from __future__ import annotations

import argparse
import platform
import random
import time
import tracemalloc

from stacklens.cct import CCT, Frame

METRIC_MIX = (("gpu_time_ns", 1_000, 200_000), ("launch_count", 1, 1), ("cpu_samples", 1, 1), ("api_cpu_ns", 500, 5_000))


def make_paths(contexts: int, depth: int, rng: random.Random) -> list[tuple[Frame, ...]]:
    kinds = [Frame.python("train.py", "step", 0)] * 8 + [Frame.op("aten::x")] * 6 + [Frame.native("libtorch.so", "s")] * 4
    paths: list[tuple[Frame, ...]] = []
    seen: set[tuple[Frame, ...]] = set()
    serial = 0
    while len(paths) < contexts:
        prefix = paths[rng.randrange(len(paths))][: rng.randrange(depth // 2, depth)] if paths else ()
        path = list(prefix)
        while len(path) < depth:
            serial += 1
            template = kinds[min(len(path), len(kinds) - 1)]
            if len(path) == depth - 1:
                path.append(Frame.kernel(f"kernel_{serial}"))
            else:
                path.append(template._replace(name=f"{template.name}_{serial}", line=serial % 1000))
        key = tuple(path)
        if key not in seen:
            seen.add(key)
            paths.append(key)
    return paths


def make_events(
    paths: list[tuple[Frame, ...]], n: int, rng: random.Random, skew: float = 0.0
) -> list[tuple[tuple[Frame, ...], str, int]]:
    """Events over `paths`: uniformly drawn, or with the i-th path weighted 1/(i+1)**skew."""
    weights = [1 / (i + 1) ** skew for i in range(len(paths))] if skew else None
    picks = rng.choices(range(len(paths)), weights=weights, k=n)
    events = []
    for i in picks:
        metric, lo, hi = METRIC_MIX[i % len(METRIC_MIX)]
        events.append((paths[i], metric, rng.randint(lo, hi)))
    return events


def run_cct(events, max_nodes: int = 100_000) -> float:
    tree = CCT(max_nodes=max_nodes)
    add = tree.add
    t0 = time.perf_counter()
    for path, metric, value in events:
        add(path, metric, value)
    return time.perf_counter() - t0


def run_dict(events) -> float:
    counts: dict = {}
    get = counts.get
    t0 = time.perf_counter()
    for path, _metric, value in events:
        counts[path] = get(path, 0) + value
    return time.perf_counter() - t0


def best_times(events, repeat: int) -> tuple[float, float]:
    """Best of `repeat` runs each, alternating, so that load from elsewhere hits both alike."""
    cct_s = dict_s = float("inf")
    for _ in range(repeat):
        cct_s = min(cct_s, run_cct(events))
        dict_s = min(dict_s, run_dict(events))
    return cct_s, dict_s


def memory(events, rounds: int) -> tuple[int, int, int, CCT]:
    """(peak during the first pass, tree memory after 1 pass, after `rounds` passes, tree)."""
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    tree = CCT()
    add = tree.add
    for path, metric, value in events:
        add(path, metric, value)
    after_one, peak = tracemalloc.get_traced_memory()
    for _ in range(rounds - 1):
        for path, metric, value in events:
            add(path, metric, value)
    after_all = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    return peak - base, after_one - base, after_all - base, tree


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--events", type=int, default=1_000_000)
    parser.add_argument("--contexts", type=int, default=10_000)
    parser.add_argument("--depth", type=int, default=20)
    parser.add_argument("--repeat", type=int, default=5, help="timing runs; the best is kept")
    parser.add_argument("--rounds", type=int, default=10, help="passes over the stream for the memory check")
    parser.add_argument("--small-cap", type=int, default=25_000, help="max_nodes for the over-the-cap run")
    args = parser.parse_args()

    rng = random.Random(42)
    paths = make_paths(args.contexts, args.depth, rng)
    events = make_events(paths, args.events, rng)

    cct_s, dict_s = best_times(events, args.repeat)
    peak, one, many, tree = memory(events, args.rounds)
    t0 = time.perf_counter()
    snap = tree.snapshot()
    snap_s = time.perf_counter() - t0
    capped_s = run_cct(events, args.small_cap)
    zipf_s = run_cct(make_events(paths, args.events, rng, skew=1.1), args.small_cap)

    n = args.events
    print(f"python {platform.python_version()} on {platform.machine()}, {args.contexts} contexts x {args.depth} frames, {tree.node_count} nodes")
    print(f"CCT.add          {n / cct_s:>12,.0f} events/s  ({cct_s * 1e9 / n:.0f} ns/event)")
    print(f"dict counter     {n / dict_s:>12,.0f} events/s  ({dict_s * 1e9 / n:.0f} ns/event)")
    print(f"ratio CCT/dict   {cct_s / dict_s:>12.2f}x   (limit 3x)")
    print(f"peak memory      {peak / 2**20:>12.1f} MiB during the first {n:,} events")
    print(f"tree memory      {one / 2**20:>12.1f} MiB after {n:,} events")
    print(f"tree memory      {many / 2**20:>12.1f} MiB after {n * args.rounds:,} events ({(many - one) / one:+.1%}, limit 5%)")
    print(f"snapshot         {snap_s * 1e3:>12.0f} ms  ({snap.node_count} nodes, {len(tree.metrics)} metrics)")
    print(f"CCT.add, capped  {n / capped_s:>12,.0f} events/s  ({capped_s * 1e9 / n:.0f} ns/event, max_nodes={args.small_cap:,}, uniform)")
    print(f"CCT.add, capped  {n / zipf_s:>12,.0f} events/s  ({zipf_s * 1e9 / n:.0f} ns/event, max_nodes={args.small_cap:,}, Zipf 1.1)")


if __name__ == "__main__":
    main()
