"""Samples by thread (issue 22: pprof's thread labels): a bounded {tid: count} per node and metric.

Pure data, no privilege, no I/O. `CCT.add_sample(path, metric, tid)` also counts the value by
thread, per node: {tid: count} for at most MAX_THREADS threads per node and metric, the first
ones seen there. A later thread's values, and those of tid 0 (not known), are in the node's value
only: what the listed threads leave of it is "[other threads]", so every total stays exact and
the breakdown costs at most MAX_THREADS entries per node and metric (THREAD_NODE_BYTES plus
THREAD_BYTES each, in `CCT.estimated_bytes`). Folds (fold.py) and merges carry the counts with
the values.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

MAX_THREADS = 8  # threads counted apart per node and metric; the rest is "[other threads]"

# Estimated bytes (64-bit CPython 3.10-3.13), as tree.py's NODE_BYTES and the like.
THREAD_NODE_BYTES = 230  # a node's {tid: count} dict and its slot in the metric's node dict
THREAD_BYTES = 90        # one thread's entry in it (an int key and value)


def count_threads(by_node: dict[int, dict[int, int]], node: int, counts: Iterable[tuple[int, int]],
                  sign: int = 1) -> int:
    """Add (tid, count) pairs to `node`'s breakdown, at most MAX_THREADS threads (a later one's
    count stays in the node's value only); a count that reaches 0 goes. Returns the change in
    estimated bytes."""
    grown = 0
    threads = by_node.get(node)
    if threads is None:
        threads = by_node[node] = {}
        grown += THREAD_NODE_BYTES
    for tid, count in counts:
        n = threads.get(tid)
        if n is None:
            if len(threads) >= MAX_THREADS:
                continue
            n = 0
            grown += THREAD_BYTES
        n += sign * count
        if n:
            threads[tid] = n
        else:
            del threads[tid]
            grown -= THREAD_BYTES
    if not threads:
        del by_node[node]
        grown -= THREAD_NODE_BYTES
    return grown


def threads_bytes(threads: Mapping[str, Mapping[int, Mapping[int, int]]]) -> int:
    """Estimated bytes of a tree's breakdowns (metric -> node -> {tid: count})."""
    return sum(THREAD_NODE_BYTES * len(b) + THREAD_BYTES * sum(map(len, b.values())) for b in threads.values())
