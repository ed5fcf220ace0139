"""Joining CUPTI kernel records to BPF launches by launch order, without CUPTI API records.

Why: CUPTI's RUNTIME/DRIVER API activity doubles the records the agent turns into Python objects
on the target's GIL, and (measured on the H200, docs/benchmarks/gpu.md) API tracing is what is
suspected of leaving a cost behind after detach. Without API records a kernel record carries no
thread id and no host time, but its correlation id orders it: with kernel activity alone, ids
step by exactly one per launch call (measured: docs/benchmarks/gpu-run3/join_probe.json), and
the kernels of one graph launch share one id.

Rule: kernel records wait SETTLE_NS after arrival (CUPTI hands buffers over out of order across
streams), then are taken in correlation-id order, one group per id; each group claims the
oldest pending BPF launch (kind launch or graph, in entry-time order, after the collector was
enabled) whose decoded grid/block match the group's first kernel and whose entry is not after the
kernel's start (a launch cannot follow its kernel). Threads launching at the same time can take
correlation ids in a different order than their uprobes fired, so a launch skipped over stays
claimable while it is within REORDER_NS of the claimed one; older ones are counted as never
reported by CUPTI and dropped; a group with no such launch within LOOKAHEAD pending launches is charged to
`[launch not seen]` (its GPU time stays in the totals, visibly unattributed). Where repeated
identical kernels lose one record, the claim can land one launch early — on the same kernel from
the same code in practice; the counters say how often anything was skipped.
"""

from __future__ import annotations

import collections
import heapq
from dataclasses import dataclass
from typing import Any, Callable

SETTLE_NS = 3_000_000_000      # > the collector's 1 s flush period + transport
LOOKAHEAD = 256
REORDER_NS = 500_000            # uprobe entry vs correlation-id order between threads
START_SLACK_NS = 20_000         # clock calibration error allowance (launch entry vs kernel start)
MAX_PENDING = 1 << 18
MAX_AGE_NS = 60_000_000_000


@dataclass(slots=True)
class PendingLaunch:
    ktime_ns: int
    path: tuple
    sig: tuple | None            # (grid_x, grid_y, grid_z, block_x, block_y, block_z), None = any (graphs)


def kernel_sig(rec: Any) -> tuple:
    return tuple(rec.grid) + tuple(rec.block)


def launch_sig(args: dict | None) -> tuple | None:
    """The grid/block of a BPF launch event's decoded arguments, or None if it has none."""
    if not args:
        return None
    try:
        return (int(args["grid_x"]), int(args["grid_y"]), int(args["grid_z"]),
                int(args["block_x"]), int(args["block_y"]), int(args["block_z"]))
    except (KeyError, TypeError, ValueError):
        return None


class OrderJoin:
    def __init__(self) -> None:
        self.launches: collections.deque[PendingLaunch] = collections.deque()
        self.groups: dict[int, list] = {}     # correlation id -> [arrival ns, [kernel records]]
        self.heap: list[int] = []
        self.enabled_at_ns = 0                # the collector's (latest) enable time, CLOCK_MONOTONIC
        self.stats = {"order_groups": 0, "order_skipped_launches": 0, "order_unseen_groups": 0,
                      "order_before_enable": 0, "order_sig_mismatch_skips": 0, "order_reordered": 0}

    def on_launch(self, ktime_ns: int, path: tuple, sig: tuple | None) -> None:
        q = self.launches
        item = PendingLaunch(ktime_ns, path, sig)
        if q and ktime_ns < q[-1].ktime_ns:  # rare: keep entry-time order
            i = len(q)
            while i and q[i - 1].ktime_ns > ktime_ns:
                i -= 1
            q.insert(i, item)
        else:
            q.append(item)
        if len(q) > MAX_PENDING:
            q.popleft()
            self.stats["order_skipped_launches"] += 1

    def on_kernel(self, rec: Any, now_ns: int) -> None:
        g = self.groups.get(rec.correlation_id)
        if g is None:
            self.groups[rec.correlation_id] = [now_ns, [rec]]
            heapq.heappush(self.heap, rec.correlation_id)
        else:
            g[1].append(rec)

    def drain(self, now_ns: int, charge: Callable[[tuple | None, Any], None], force: bool = False) -> int:
        """Join every settled group (all of them if force); returns how many were joined."""
        n = 0
        q = self.launches
        if not force:  # launches no kernel record claimed within MAX_AGE_NS never will
            while q and now_ns - q[0].ktime_ns > MAX_AGE_NS:
                q.popleft()
                self.stats["order_skipped_launches"] += 1
        while self.heap:
            corr = self.heap[0]
            arrived, recs = self.groups[corr]
            if not force and now_ns - arrived < SETTLE_NS:
                break
            heapq.heappop(self.heap)
            del self.groups[corr]
            n += 1
            self.stats["order_groups"] += 1
            while q and q[0].ktime_ns < self.enabled_at_ns:
                q.popleft()
                self.stats["order_before_enable"] += 1
            first = min(recs, key=lambda r: r.start_ns)
            sig = kernel_sig(first)
            latest = first.start_ns + START_SLACK_NS
            pick = None
            for i in range(min(LOOKAHEAD, len(q))):
                cand = q[i]
                if cand.ktime_ns > latest:
                    break
                if cand.sig is None or cand.sig == sig:
                    pick = i
                    break
            if pick is None:
                self.stats["order_unseen_groups"] += 1
                for r in recs:
                    charge(None, r)
                continue
            claim = q[pick]
            if pick:
                self.stats["order_sig_mismatch_skips"] += 1
                del q[pick]
                keep_from = claim.ktime_ns - REORDER_NS
                while q and q[0].ktime_ns < keep_from and pick:
                    q.popleft()
                    pick -= 1
                    self.stats["order_skipped_launches"] += 1
                if pick:  # launches from just before the claim stay: another thread's, id not yet seen
                    self.stats["order_reordered"] += 1
            else:
                q.popleft()
            for r in recs:
                charge(claim.path, r)
        return n
