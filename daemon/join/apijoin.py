"""The exact GPU join: CUPTI API records say which BPF call each kernel, copy or memset came from.

Pure (no privilege, no I/O); one of the two `GpuJoin`s (daemon/join/gpujoin.py), used when the agent
sends CUPTI RUNTIME/DRIVER API records (`gpu_api_records=True`).

Rule: a launch's path waits in a per-thread queue until the CUPTI API record of the same thread
whose [start, end] holds the BPF timestamp (clocks calibrated by the agent to CLOCK_MONOTONIC)
claims it; the kernel records with that correlation id then go to the exact launching path.
Copy and memset calls do the same in queues of their own (a copy record claims a call, never a
launch); a copy or memset node of a CUDA graph joins through its graph launch's correlation id.
Unmatched launches and calls age out and are counted, never guessed.

Cost: one small slotted object per launch while it waits, one dict entry per correlation id.
"""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass
from typing import Callable, Deque

from stacklens.daemon.join.gpujoin import Charges, CopyCall, LaunchEvent, Path
from stacklens.daemon.join.orderjoin import sorted_pos_from_end
from stacklens.records.agent import ApiRecord, KernelRecord, MemcpyRecord

PENDING_MAX_AGE_NS = 30_000_000_000
# The uprobe fires at the launch function's first instruction, CUPTI stamps the API record a little
# later, and the clock calibration is good to about a microsecond: a launch belongs to the API
# record of its thread whose [start - EARLY, end + SLACK] holds its BPF time.
CLAIM_SLACK_NS = 2_000
CLAIM_EARLY_NS = 1_000_000
PENDING_MAX_PER_THREAD = 65_536
COPY_WAIT_MAX_NS = 10_000_000_000   # a copy record waits this long for its API record


@dataclass(slots=True)
class PendingLaunch:
    ktime_ns: int
    path: Path


@dataclass(slots=True)
class _Waiting:
    """Copy/memset records of one correlation id whose API record has not come yet."""
    since_ns: int
    recs: list[MemcpyRecord]


def _ktime_of(p: PendingLaunch | CopyCall) -> int:
    return p.ktime_ns


def is_copy_api(name: str) -> bool:
    """A CUPTI API record of a copy or memset call (cudaMemcpyAsync, cuMemsetD32Async …), not a
    graph-building one (cudaGraphAddMemcpyNode): the agent keeps the same cbids."""
    return ("Memcpy" in name or "Memset" in name) and "Graph" not in name


def _claim_from(q: Deque | None, last_claims: dict, api: ApiRecord, dropped: Callable) -> PendingLaunch | CopyCall | None:
    """The pending call (of queue `q`, sorted by time) that CUPTI API record `api` claims: the
    last one that entered before the record ended, if it entered no earlier than CLAIM_EARLY_NS
    before its start; the calls before it were never reported (`dropped` gets each). Else the
    thread's last claim, when it lies inside the record (a runtime record around its driver
    record). None when nothing fits."""
    hi = api.end_ns + CLAIM_SLACK_NS
    n = 0
    if q:
        while n < len(q) and q[n].ktime_ns <= hi:
            n += 1
    if n and q[n - 1].ktime_ns >= api.start_ns - CLAIM_EARLY_NS:
        for _ in range(n - 1):
            dropped(q.popleft())
        claim = last_claims[api.tid] = q.popleft()
        return claim
    last = last_claims.get(api.tid)
    if last is not None and api.start_ns - CLAIM_EARLY_NS <= last.ktime_ns <= hi:
        return last
    return None


def _insert_sorted(q: Deque, item: PendingLaunch | CopyCall) -> None:
    """Append, or (out of order) insert after the equal times: the queue stays sorted."""
    if q and item.ktime_ns < q[-1].ktime_ns:
        q.insert(sorted_pos_from_end(q, item.ktime_ns, _ktime_of), item)
    else:
        q.append(item)


class ApiRecordJoin:
    """`GpuJoin` through CUPTI API records (the module docstring)."""

    def __init__(self, charges: Charges, clock: Callable[[], float] = time.monotonic) -> None:
        self._charges = charges
        self._clock = clock
        self.pending: dict[int, Deque[PendingLaunch]] = collections.defaultdict(collections.deque)
        self._last_claim: dict[int, PendingLaunch] = {}
        # correlation id → launching path; kept (bounded) because a graph launch has many kernels
        self._by_correlation: collections.OrderedDict[int, Path] = collections.OrderedDict()
        self._kernels_waiting: dict[int, list[KernelRecord]] = {}
        self.pending_copies: dict[int, Deque[CopyCall]] = collections.defaultdict(collections.deque)
        self._last_copy_claim: dict[int, CopyCall] = {}
        self._copy_by_corr: collections.OrderedDict[int, CopyCall] = collections.OrderedDict()
        self._copies_waiting: dict[int, _Waiting] = {}

    # ---- BPF side -------------------------------------------------------------------------
    def on_launch(self, ev: LaunchEvent, path: Path) -> None:
        q = self.pending[ev.tid]
        _insert_sorted(q, PendingLaunch(ev.ktime_ns, path))
        if len(q) > PENDING_MAX_PER_THREAD:
            q.popleft()
            self._charges.launch_dropped()

    def on_copy_call(self, ev: LaunchEvent, call: CopyCall) -> None:
        q = self.pending_copies[ev.tid]
        _insert_sorted(q, call)
        if len(q) > PENDING_MAX_PER_THREAD:
            self._charges.copy_dropped(q.popleft())

    # ---- agent side -----------------------------------------------------------------------
    def on_api(self, rec: ApiRecord) -> None:
        if "Launch" in rec.name:
            self._claim(rec)
        elif is_copy_api(rec.name):
            self._claim_copy(rec)

    def _launch_dropped(self, _launch: PendingLaunch) -> None:
        self._charges.launch_dropped()

    def _claim(self, api: ApiRecord) -> None:
        """A CUPTI launch API record claims the BPF launch of the same thread inside its interval.

        Per thread, launches and their API records come in the same order: the record claims the
        last pending launch that entered before it ended; launches before that one were never
        reported by CUPTI (before activation, or dropped) and are counted, not charged.
        A runtime launch (cudaLaunchKernel) wraps a driver launch: the driver record (which exits
        first) claims the BPF event; the enclosing runtime record then maps its correlation id to
        the same path, so kernels correlated with either land on it.
        """
        claim = _claim_from(self.pending.get(api.tid), self._last_claim, api, self._launch_dropped)
        if claim is None:
            return
        self._by_correlation[api.correlation_id] = claim.path
        if len(self._by_correlation) > PENDING_MAX_PER_THREAD:
            self._by_correlation.popitem(last=False)
        for krec in self._kernels_waiting.pop(api.correlation_id, ()):
            self._charges.kernel(claim.path, krec)
        if self._copies_waiting:                # copy/memset nodes of a graph launch
            w = self._copies_waiting.pop(api.correlation_id, None)
            for crec in w.recs if w is not None else ():
                self._charges.copy(claim.path, crec)

    def _claim_copy(self, api: ApiRecord) -> None:
        """A CUPTI API record of a copy/memset call claims the thread's pending call inside its
        interval (`_claim`'s rule); calls before it were never reported and keep their own bytes."""
        claim = _claim_from(self.pending_copies.get(api.tid), self._last_copy_claim, api,
                            self._charges.copy_dropped)
        if claim is None:
            return
        self._copy_by_corr[api.correlation_id] = claim
        if len(self._copy_by_corr) > PENDING_MAX_PER_THREAD:
            self._copy_by_corr.popitem(last=False)
        w = self._copies_waiting.pop(api.correlation_id, None)
        for rec in w.recs if w is not None else ():
            self._charges.copy(claim.path, rec)

    def on_kernel(self, rec: KernelRecord) -> None:
        path = self._by_correlation.get(rec.correlation_id)
        if path is None:
            waiting = self._kernels_waiting.setdefault(rec.correlation_id, [])
            waiting.append(rec)
            if len(self._kernels_waiting) > PENDING_MAX_PER_THREAD:
                self._kernels_waiting.pop(next(iter(self._kernels_waiting)))
                self._charges.kernel_lost()
            return
        self._charges.kernel(path, rec)

    def on_copy(self, rec: MemcpyRecord) -> None:
        corr = rec.correlation_id
        call = self._copy_by_corr.get(corr)
        if call is not None:
            self._charges.copy(call.path, rec)
            return
        path = self._by_correlation.get(corr)    # a node of a graph launch
        if path is not None:
            self._charges.copy(path, rec)
            return
        w = self._copies_waiting.get(corr)
        if w is None:
            w = self._copies_waiting[corr] = _Waiting(int(self._clock() * 1e9), [])
            if len(self._copies_waiting) > PENDING_MAX_PER_THREAD:
                for old in self._copies_waiting.pop(next(iter(self._copies_waiting))).recs:
                    self._charges.copy_unseen(old)
        w.recs.append(rec)

    def on_enabled(self, t_ns: int) -> None:
        """Nothing to do: a launch from before the collector was enabled has no API record to
        claim it, and ages out."""

    # ---- ageing ---------------------------------------------------------------------------
    def expire(self, now_ns: int) -> None:
        for q in self.pending.values():
            while q and now_ns - q[0].ktime_ns > PENDING_MAX_AGE_NS:
                q.popleft()
                self._charges.launch_dropped()
        self._expire_copies(now_ns, False)

    def finish(self) -> None:
        """Copies and memsets: every call keeps its own bytes, every record goes unseen. Launches
        stay (`waiting_launches` counts them)."""
        self._expire_copies(0, True)

    def settle(self) -> None:
        """Nothing waits to settle: a record joins as it arrives."""

    def _expire_copies(self, now_ns: int, force: bool) -> None:
        """Calls and records that waited too long (all of them if `force`): calls keep their own
        bytes, records land under `[copy call not seen]`."""
        for q in self.pending_copies.values():
            while q and (force or now_ns - q[0].ktime_ns > PENDING_MAX_AGE_NS):
                self._charges.copy_dropped(q.popleft())
        if self._copies_waiting:
            now = int(self._clock() * 1e9)
            for corr in [c for c, w in self._copies_waiting.items() if force or now - w.since_ns > COPY_WAIT_MAX_NS]:
                for rec in self._copies_waiting.pop(corr).recs:
                    self._charges.copy_unseen(rec)

    def waiting_launches(self) -> int:
        return sum(len(q) for q in self.pending.values())

    def stats(self) -> dict[str, int]:
        return {}
