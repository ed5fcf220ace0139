"""api_cpu_ns is time inside non-sync API calls; a sync call's wait is sync_wait_ns only, and a
live profile says launch API time is not measured (issue 23: api_cpu_ns used to equal
sync_wait_ns and was shown as the API's CPU time)."""

from __future__ import annotations

from stacklens.analyzer.view import View
from stacklens.cct import Frame
from stacklens.daemon.join.joiner import Joiner
from tests.fakes.sources import FakeEvent, py

LINE = (py("main", 1), py("step", 7))


def test_sync_wait_is_counted_once_and_not_as_api_time():
    j = Joiner(1, agent=False)
    j.on_bpf(FakeEvent(kind="sync", api="cuCtxSynchronize", py_stack=LINE, duration_ns=7_000_000))
    j.on_bpf(FakeEvent(kind="alloc", api="cuMemAlloc_v2", py_stack=LINE, bytes=1 << 20, duration_ns=40_000))
    j.on_bpf(FakeEvent(kind="launch", api="cuLaunchKernel", py_stack=LINE, kernel_name="k"))
    snap = j.snapshot()
    assert snap.total("sync_wait_ns") == 7_000_000
    assert snap.total("api_cpu_ns") == 40_000        # the allocation only
    sync = snap.find([f.label() for f in LINE] + [Frame.api("cuCtxSynchronize").label()])
    assert snap.exclusive(sync, "api_cpu_ns") == 0
    # the launch was counted, its API time is declared unmeasured rather than shown as 0
    assert snap.total("launch_count") == 1
    assert "launch" in snap.meta["partial"]["api_cpu_ns"]
    # the analyzer's fallback time base (no duration in meta) adds the wait once
    assert View(snap).wall_ns == 7_040_000
