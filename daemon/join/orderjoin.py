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

Copies and memsets use a second OrderJoin of their own: records claim the BPF copy/memset calls
(sig_of = copy_sig: memcpy or memset, and the bytes), and a call no record claims goes to
on_drop, which charges the bytes the call asked for. A copy or memset node of a CUDA graph shares
its graph launch's correlation id and joins the kernel groups here (its sig () matches only a
graph launch). `LaunchOrderJoin` holds the two queues: it is the `GpuJoin` (daemon/join/gpujoin.py)
of sessions without API records.

Cost (issue 9: ~25k launches/s on an H200 ViT job): a pending launch is one entry in each of
three parallel deques (entry time, path, sig: no object of its own, so nothing per launch for the
garbage collector to scan while it waits); correlation ids that arrive in ascending order (the common case) go into a
sorted run (a deque) and only the others into a heap; a group of one record (no graph launch) is
the record itself, not a list; the oldest pending launch is tried before the lookahead scan.
"""

from __future__ import annotations

import collections
import heapq
import time
from typing import TYPE_CHECKING, Any, Callable, Union

from stacklens.records.agent import ApiRecord, KernelRecord, MemcpyRecord

if TYPE_CHECKING:
    from stacklens.daemon.join.gpujoin import Charges, CopyCall, LaunchEvent, Path

# what a queue holds: kernel records, and (in the kernel queue) the copy/memset nodes of graphs
GpuRecord = Union[KernelRecord, MemcpyRecord]

SETTLE_NS = 3_000_000_000      # > the collector's 1 s flush period + transport
LOOKAHEAD = 256
REORDER_NS = 500_000            # uprobe entry vs correlation-id order between threads
START_SLACK_NS = 20_000         # clock calibration error allowance (launch entry vs kernel start)
MAX_PENDING = 1 << 18
MAX_AGE_NS = 60_000_000_000


def kernel_sig(rec: GpuRecord) -> tuple:
    """(grid_x, grid_y, grid_z, block_x, block_y, block_z) of a kernel record; () for a copy or
    memset node of a CUDA graph (grouped with the graph's kernels: it matches graph launches only)."""
    g, b = getattr(rec, "grid", ()), getattr(rec, "block", ())
    if type(g) is tuple and type(b) is tuple:  # the common case: no copies
        return g + b
    return tuple(g) + tuple(b)


def copy_sig(rec: MemcpyRecord) -> tuple:
    """What a copy or memset record and the BPF event of its call both know: ("memset" or
    "memcpy", bytes). The call's event carries the same pair (`GpuCharges.copy_call` computes it)."""
    return ("memset" if rec.kind == "memset" else "memcpy", rec.bytes)


_SIG_MEMO: dict[tuple, tuple] = {}


def launch_sig(args: dict | None) -> tuple | None:
    """The grid/block of a BPF launch event's decoded arguments, or None if it has none.

    Memoized on the raw values: the same dimensions give the same (int) tuple object."""
    if not args:
        return None
    try:
        raw = (args["grid_x"], args["grid_y"], args["grid_z"], args["block_x"], args["block_y"], args["block_z"])
        sig = _SIG_MEMO.get(raw)
    except (KeyError, TypeError):  # TypeError: not a mapping, or an unhashable value
        return None
    if sig is None:
        try:
            sig = tuple(map(int, raw))
        except (TypeError, ValueError):
            return None
        if len(_SIG_MEMO) >= 4096:
            _SIG_MEMO.clear()
        _SIG_MEMO[raw] = sig
    return sig


def sorted_pos_from_end(q, t: int, key=None) -> int:
    """Where t goes in the sorted q (after equal items), scanning back from the end: a launch out
    of order is late by a few places, and bisect on a long deque (O(n) indexing) costs ~10x more."""
    i = len(q)
    if key is None:
        while i and q[i - 1] > t:
            i -= 1
    else:
        while i and key(q[i - 1]) > t:
            i -= 1
    return i


class OrderJoin:
    """Records claim pending BPF events in correlation-id order (the module docstring).

    sig_of: a record's signature, compared with each pending event's (kernel_sig for kernels,
    copy_sig for the copy queue). A pending event's "path" is what the queue hands back: a launch
    path (kernels) or a `CopyCall` (copies); `drain` calls charge(it or None, record). on_drop:
    called with the path of every pending event removed without a claim (skipped, aged, before
    the collector was enabled, `discard`)."""

    def __init__(self, sig_of: Callable[[GpuRecord], tuple] = kernel_sig,
                 on_drop: Callable[[Any], None] | None = None) -> None:
        self.sig_of = sig_of
        self.on_drop = on_drop
        # pending launches in entry-time order, as parallel deques: entry time, path, and sig =
        # (grid_x, grid_y, grid_z, block_x, block_y, block_z) or None = any (graph launches)
        self.times: collections.deque[int] = collections.deque()
        self.paths: collections.deque[tuple] = collections.deque()
        self.sigs: collections.deque[tuple | None] = collections.deque()
        self.groups: dict[int, GpuRecord] = {}  # correlation id -> its first kernel record
        self.more: dict[int, list] = {}       # correlation id -> the group's other records (graphs)
        self.arrived: dict[int, int] = {}     # correlation id -> arrival ns of its first record
        self.run: collections.deque[int] = collections.deque()  # ids that arrived ascending
        self.heap: list[int] = []             # the others
        self.enabled_at_ns = 0                # the collector's (latest) enable time, CLOCK_MONOTONIC
        self.stats = {"order_groups": 0, "order_skipped_launches": 0, "order_unseen_groups": 0,
                      "order_before_enable": 0, "order_sig_mismatch_skips": 0, "order_reordered": 0}

    def on_launch(self, ktime_ns: int, path: tuple, sig: tuple | None) -> None:
        times = self.times
        if times and ktime_ns < times[-1]:  # rare: keep entry-time order (after equal times)
            i = sorted_pos_from_end(times, ktime_ns)
            times.insert(i, ktime_ns)
            self.paths.insert(i, path)
            self.sigs.insert(i, sig)
        else:
            times.append(ktime_ns)
            self.paths.append(path)
            self.sigs.append(sig)
        if len(times) > MAX_PENDING:
            self._pop()
            self.stats["order_skipped_launches"] += 1

    def _pop(self) -> None:
        self.times.popleft()
        path = self.paths.popleft()
        self.sigs.popleft()
        if self.on_drop is not None:
            self.on_drop(path)

    def discard(self) -> None:
        """Drop every pending event (at detach, after a forced drain): counted, handed to on_drop."""
        while self.times:
            self._pop()
            self.stats["order_skipped_launches"] += 1

    def on_kernel(self, rec: GpuRecord, now_ns: int) -> None:
        corr = rec.correlation_id
        groups = self.groups
        if corr in groups:
            m = self.more.get(corr)
            if m is None:
                self.more[corr] = [rec]
            else:
                m.append(rec)
            return
        groups[corr] = rec
        self.arrived[corr] = now_ns
        run = self.run
        if not run or corr > run[-1]:
            run.append(corr)
        else:
            heapq.heappush(self.heap, corr)

    def drain(self, now_ns: int, charge: Callable[[Any, GpuRecord], None], force: bool = False) -> int:
        """Join every settled group (all of them if force); returns how many were joined."""
        n = 0
        times, paths, sigs = self.times, self.paths, self.sigs
        stats = self.stats
        qpop = self._pop
        if not force:  # launches no kernel record claimed within MAX_AGE_NS never will
            while times and now_ns - times[0] > MAX_AGE_NS:
                qpop()
                stats["order_skipped_launches"] += 1
        run, heap, groups, arrived, more = self.run, self.heap, self.groups, self.arrived, self.more
        popleft, heappop = run.popleft, heapq.heappop
        tpop, ppop, spop = times.popleft, paths.popleft, sigs.popleft
        enabled = self.enabled_at_ns
        sig_of = self.sig_of
        before_enable = 0
        try:
            while True:
                if run:
                    corr = run[0]
                    from_heap = bool(heap) and heap[0] < corr
                    if from_heap:
                        corr = heap[0]
                elif heap:
                    corr = heap[0]
                    from_heap = True
                else:
                    break
                if not force and now_ns - arrived[corr] < SETTLE_NS:
                    break
                if from_heap:
                    heappop(heap)
                else:
                    popleft()
                first = groups.pop(corr)
                del arrived[corr]
                recs = None
                if more:
                    extra = more.pop(corr, None)
                    if extra is not None:
                        recs = [first]
                        recs += extra
                        first = min(recs, key=_start_of)
                n += 1
                while times and times[0] < enabled:
                    qpop()
                    before_enable += 1
                sig = sig_of(first)
                latest = first.start_ns + START_SLACK_NS
                if times and times[0] <= latest:
                    s0 = sigs[0]
                    if s0 is None or s0 == sig:  # the common case: the oldest pending launch
                        tpop()
                        spop()
                        path = ppop()
                        if recs is None:
                            charge(path, first)
                        else:
                            for r in recs:
                                charge(path, r)
                        continue
                self._claim_further(recs if recs is not None else (first,), sig, latest, charge)
        finally:
            stats["order_groups"] += n
            stats["order_before_enable"] += before_enable
        return n

    def _claim_further(self, recs, sig, latest: int, charge: Callable[[Any, GpuRecord], None]) -> None:
        """The group's oldest pending launch did not fit (later than `latest`, or another
        signature): the first fitting one of the next LOOKAHEAD claims it, or nothing does."""
        times, paths, sigs, stats = self.times, self.paths, self.sigs, self.stats
        pick = None
        for i in range(1, min(LOOKAHEAD, len(times))):
            if times[i] > latest:
                break
            s0 = sigs[i]
            if s0 is None or s0 == sig:
                pick = i
                break
        if pick is None:
            stats["order_unseen_groups"] += 1
            for r in recs:
                charge(None, r)
            return
        claim_t, claim_path = times[pick], paths[pick]
        stats["order_sig_mismatch_skips"] += 1
        del times[pick], paths[pick], sigs[pick]
        keep_from = claim_t - REORDER_NS
        while times and times[0] < keep_from and pick:
            self._pop()
            pick -= 1
            stats["order_skipped_launches"] += 1
        if pick:  # launches from just before the claim stay: another thread's, id not yet seen
            stats["order_reordered"] += 1
        for r in recs:
            charge(claim_path, r)


def _start_of(rec: GpuRecord) -> int:
    return rec.start_ns


class LaunchOrderJoin:
    """`GpuJoin` by launch order (the module docstring): one OrderJoin for kernels (and the copy
    and memset nodes of CUDA graphs), one for copy and memset calls. API records are not used."""

    def __init__(self, charges: Charges, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._kernel, self._kernel_unseen = charges.kernel, charges.kernel_unseen
        self._copy, self._copy_unseen = charges.copy, charges.copy_unseen
        self.kernels = OrderJoin()
        self.copies = OrderJoin(copy_sig, charges.copy_dropped)

    def on_launch(self, ev: LaunchEvent, path: Path) -> None:
        q = self.kernels
        t = ev.ktime_ns
        sig = launch_sig(getattr(ev, "args", None)) if ev.kind == "launch" else None
        times = q.times
        if (times and t < times[-1]) or len(times) >= MAX_PENDING:
            q.on_launch(t, path, sig)           # out of order, or full: the queue's own rule
        else:                                   # the common case, inline (one launch each, issue 9)
            times.append(t)
            q.paths.append(path)
            q.sigs.append(sig)

    def on_copy_call(self, ev: LaunchEvent, call: CopyCall) -> None:
        self.copies.on_launch(ev.ktime_ns, call, (call.kind, call.nbytes))

    def on_api(self, rec: ApiRecord) -> None:
        """Not used: this join is chosen when the agent sends no API records."""

    def on_kernel(self, rec: KernelRecord) -> None:
        self.kernels.on_kernel(rec, int(self._clock() * 1e9))

    def on_copy(self, rec: MemcpyRecord) -> None:
        (self.kernels if rec.graph_id else self.copies).on_kernel(rec, int(self._clock() * 1e9))

    def on_enabled(self, t_ns: int) -> None:
        self.kernels.enabled_at_ns = max(self.kernels.enabled_at_ns, int(t_ns))
        self.copies.enabled_at_ns = self.kernels.enabled_at_ns

    def _charge_group(self, path: Path | None, rec: KernelRecord | MemcpyRecord) -> None:
        if type(rec) is MemcpyRecord:          # a copy/memset node of a graph, grouped with its kernels
            if path is None:
                self._copy_unseen(rec)
            else:
                self._copy(path, rec)
        elif path is None:
            self._kernel_unseen(rec)
        else:
            self._kernel(path, rec)

    def _charge_copy(self, call: CopyCall | None, rec: MemcpyRecord) -> None:
        if call is None:
            self._copy_unseen(rec)
        else:
            self._copy(call.path, rec)

    def expire(self, now_ns: int) -> None:
        """Join the groups that have settled, by the join's clock (`now_ns`, the session's, is
        for the exact join's ageing)."""
        self.kernels.drain(int(self._clock() * 1e9), self._charge_group)
        self.copies.drain(int(self._clock() * 1e9), self._charge_copy)

    def finish(self) -> None:
        """Join every group; copy calls left unclaimed keep their own bytes (`discard`)."""
        self.kernels.drain(0, self._charge_group, force=True)
        self.copies.drain(0, self._charge_copy, force=True)
        self.copies.discard()

    def settle(self) -> None:
        """Join every group received, settled or not: after the agent's forced flush at a window's
        edge, every record of activity completed before it has arrived. Launches and copy calls
        still waiting stay for records to come."""
        self.kernels.drain(0, self._charge_group, force=True)
        self.copies.drain(0, self._charge_copy, force=True)

    def waiting_launches(self) -> int:
        """Launches no kernel record has claimed yet; after `finish` (every record drained), the
        ones none ever will: a window counts them as unjoined (they used to go uncounted)."""
        return len(self.kernels.times)

    def stats(self) -> dict[str, int]:
        d = dict(self.kernels.stats)
        for k, v in self.copies.stats.items():
            d["copy_" + k] = v
        return d
