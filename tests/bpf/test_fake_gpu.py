"""Acceptance 1: GPU API probes on fake libcuda / libamdhip64, attached by PID (root + eBPF)."""

from __future__ import annotations

import sys

import pytest

from stacklens.bpf import ProbeConfig, ProbeSession

from tests.bpf.conftest import TARGETS, poll_until

sys.path.insert(0, str(TARGETS))
from fake_slept import parse as parse_slept  # noqa: E402

pytestmark = pytest.mark.bpf
N, M = 7, 5
SYNC_US = 30000


def _attach(pid, **kw):
    s = ProbeSession(pid, ProbeConfig(cpu_sample_hz=0, **kw))
    report = s.attach()
    return s, report


def assert_sync_times(sync, slept_ns, floor_us=SYNC_US, tolerance=0.1):
    """Each measured sync lasts what the fake measured of its own sleep (in call order), within
    `tolerance`; the nominal sleep (floor_us) is only a floor (a loaded machine wakes the sleeper late)."""
    sync = sorted(sync, key=lambda e: e.ktime_ns)
    assert len(slept_ns) == len(sync), (slept_ns, [e.duration_ns for e in sync])
    for e, own in zip(sync, slept_ns):
        assert own >= floor_us * 1000 and abs(e.duration_ns - own) <= tolerance * own, (e.duration_ns, own)


def _names(stack):
    return [f.name for f in stack]


def test_cuda_launch_alloc_copy_sync(bpf_ok, fake_libs, start_target):
    t = start_target("fake_cuda_app.py", str(fake_libs["dir"]), str(N), str(M),
                     env={"FAKE_SYNC_US": str(SYNC_US)})
    s, report = _attach(t.pid)
    try:
        assert [lib.role for lib in report.libraries] == ["cuda"]
        assert report.libraries[0].probes >= 20
        t.send()
        done = t.readline()
        fwd, bwd, ptr = (int(x) for x in done.split()[1:4])
        evs = poll_until(s, lambda e: any(x.kind == "sync" for x in e))
        reused = s.stats()["native_stacks_reused"]
    finally:
        s.detach()

    launches = [e for e in evs if e.api == "cuLaunchKernel"]
    assert len(launches) == N + M
    # a loop launching from one place unwinds once, then reuses the place's stack id (gpu.bpf.c);
    # the asserts below check that every reused stack still names its own caller
    assert reused >= N + M - 8, reused
    a = [e for e in launches if e.kernel_name == "fwd_kernel"]
    b = [e for e in launches if e.kernel_name == "bwd_kernel"]
    assert len(a) == N and len(b) == M
    assert a[0].args == {"f": fwd, "grid_x": 64, "grid_y": 2, "grid_z": 1, "block_x": 256, "block_y": 1,
                         "block_z": 1, "shared_mem": 1024, "stream": 0x5151, "params": 0, "extra": 0}
    # block_z, shared memory and stream are stack arguments on x86-64
    assert (b[0].args["block_y"], b[0].args["block_z"], b[0].args["shared_mem"], b[0].args["stream"]) == (
        2, 3, 2048, 0x5252)
    assert all(e.pid == t.pid and e.tid == t.pid for e in launches)
    # native stacks reach the C caller that launched (frame pointers in libfakeapp)
    assert all("app_forward_launches" in _names(e.native_stack) for e in a)
    assert all("app_backward_launches" in _names(e.native_stack) for e in b)
    assert all(e.native_stack[-1].name == "cuLaunchKernel" for e in launches)

    ex = [e for e in evs if e.api == "cuLaunchKernelEx"]
    assert len(ex) == 3
    assert {k: ex[0].args[k] for k in ("grid_x", "grid_y", "grid_z", "block_x", "block_y", "block_z",
                                        "shared_mem", "stream", "num_attrs")} == {
        "grid_x": 7, "grid_y": 8, "grid_z": 9, "block_x": 32, "block_y": 4, "block_z": 2,
        "shared_mem": 4096, "stream": 0x5353, "num_attrs": 0}
    assert ex[0].kernel_name == "fwd_kernel"
    assert "app_ex_launches" in _names(ex[0].native_stack)

    alloc = [e for e in evs if e.kind == "alloc"]
    free = [e for e in evs if e.kind == "free"]
    assert len(alloc) == 1 and alloc[0].bytes == 1 << 20 and alloc[0].args["ptr"] == ptr
    assert len(free) == 1 and free[0].bytes == 1 << 20
    copies = {(e.api, e.direction, e.bytes) for e in evs if e.kind == "memcpy"}
    assert copies == {("cuMemcpyHtoD_v2", "HtoD", 4096), ("cuMemcpyDtoH_v2", "DtoH", 8192),
                      ("cuMemcpyDtoD_v2", "DtoD", 512), ("cuMemcpyHtoDAsync_v2", "HtoD", 256)}
    sync = [e for e in evs if e.kind == "sync"]
    assert len(sync) == 1 and sync[0].args["stream"] == 0x99
    assert_sync_times(sync, parse_slept(done))
    assert not any(e.kind == "cpu_sample" for e in evs)
    # the Python line that launched, read in BPF at the probe (exact file, function, line)
    app = str(TARGETS / "fake_cuda_app.py")
    lines = {n: i for i, l in enumerate((TARGETS / "fake_cuda_app.py").read_text().splitlines(), 1)
             for n in ("forward", "backward", "sync") if l.strip() == f"{n}(fwd, N)" or
             l.strip() == f"{n}(bwd, M)" or l.strip() == f"{n}()"}
    body = {n: i + 1 for i, l in enumerate((TARGETS / "fake_cuda_app.py").read_text().splitlines(), 1)
            for n in ("forward", "backward", "sync") if l.startswith(f"def {n}(")}
    for evs_, fn in ((a, "forward"), (b, "backward"), (sync, "sync")):
        for e in evs_:
            assert [(f.file, f.name, f.line) for f in e.py_stack] == [
                (app, "<module>", lines[fn]), (app, fn, body[fn])], e.py_stack


@pytest.mark.parametrize("second_map", [False, True], ids=["stacks", "stacks2"])
def test_native_stacks_are_unwound_once_per_place_when_launch_sites_alternate(bpf_ok, fake_libs, start_target,
                                                                              second_map):
    """A training step launches from hundreds of places in turn. The memo of native stack ids is
    keyed by place (stack and frame pointer, return address, operator path, Python stack), so
    each place is unwound once, not once per change of place; every reused stack still names its
    own caller. stacks2: every stack goes to the second stack map, as one does after a bucket
    collision in the first (SL_TEST_STACK_RETRY), and reads back whole."""
    rounds = 40
    t = start_target("alternating_launches.py", str(fake_libs["dir"]), str(rounds))
    s, _ = _attach(t.pid, extra_cflags=("-DSL_TEST_STACK_RETRY",) if second_map else ())
    try:
        t.send()
        assert t.readline().strip() == "done"
        evs = poll_until(s, lambda e: sum(x.api == "cuLaunchKernel" for x in e) >= 2 * rounds)
        st = s.stats()
    finally:
        s.detach()
    launches = [e for e in evs if e.api == "cuLaunchKernel"]
    assert len(launches) == 2 * rounds
    assert st["native_stacks_reused"] >= 2 * rounds - 4, st    # one unwind per place (+ slack)
    assert st["stack_errors"] == 0, st
    if second_map:
        assert 2 <= st["stacks_in_map2"] <= 4, st
    assert all(e.native_stack[-1].name == "cuLaunchKernel" for e in launches)
    for e in launches:
        names = _names(e.native_stack)
        own, other = (("app_forward_launches", "app_backward_launches") if e.kernel_name == "fwd_kernel"
                      else ("app_backward_launches", "app_forward_launches"))
        assert own in names and other not in names, (e.kernel_name, names)


def test_hip_launch_alloc_copy_sync(bpf_ok, fake_libs, start_target):
    t = start_target("fake_hip_app.py", str(fake_libs["dir"]), "4", env={"FAKE_SYNC_US": str(SYNC_US)})
    s, report = _attach(t.pid)
    try:
        assert [lib.role for lib in report.libraries] == ["hip"]
        t.send()
        done = t.readline()
        evs = poll_until(s, lambda e: any(x.kind == "sync" for x in e))
    finally:
        s.detach()
    launches = [e for e in evs if e.api == "hipLaunchKernel"]
    assert len(launches) == 4
    assert launches[0].args["grid_x"] == 10 and launches[0].args["grid_y"] == 20 and launches[0].args["grid_z"] == 30
    assert (launches[0].args["block_x"], launches[0].args["block_y"], launches[0].args["block_z"]) == (64, 2, 1)
    assert launches[0].args["shared_mem"] == 512 and launches[0].args["stream"] == 0x4242
    assert launches[0].kernel_name == "fake_hip_vector_add_stub"  # host stub symbolized
    mod = [e for e in evs if e.api == "hipModuleLaunchKernel"]
    assert len(mod) == 2 and mod[0].kernel_name == "hip_gemm"
    assert (mod[0].args["block_z"], mod[0].args["shared_mem"], mod[0].args["stream"]) == (10, 256, 0x4343)
    alloc = [e for e in evs if e.kind == "alloc"]
    assert len(alloc) == 1 and alloc[0].bytes == 65536
    assert [e.bytes for e in evs if e.kind == "free"] == [65536]
    assert sorted((e.direction, e.bytes) for e in evs if e.kind == "memcpy") == [("DtoH", 2000), ("HtoD", 1000)]
    sync = [e for e in evs if e.kind == "sync"]
    assert len(sync) == 1
    assert_sync_times(sync, parse_slept(done))


def test_a_sync_still_waiting_when_a_window_closes_is_counted_up_to_its_end(bpf_ok, fake_libs, start_target):
    """The probes' pending map read at the close (ProbeSession.in_flight): a target blocked in
    a 60 s cuStreamSynchronize shows its wait so far, marked, instead of nothing."""
    import time as _time

    from stacklens.daemon.session import ProcessSession

    t = start_target("fake_cuda_app.py", str(fake_libs["dir"]), "2", "2", env={"FAKE_SYNC_US": "60000000"})
    s = ProcessSession(t.pid)
    s.start(window=True)
    try:
        t.send()
        deadline = _time.monotonic() + 60
        while s.snapshot().total("launch_count") < 4 + 3 and _time.monotonic() < deadline:
            s.wait_window(0.05)      # the launches come right before the sync
        meta = s.close_window()
        snap = s.snapshot()
    finally:
        s.stop()
    assert meta["in_flight_at_end"] == 1, meta
    waits = [(p, m["sync_wait_ns"]) for p, m in snap.iter_paths() if m.get("sync_wait_ns")]
    assert len(waits) == 1 and any(f.name == "sync" for f in waits[0][0] if f.kind == "python"), waits
    assert 0 < waits[0][1] <= meta["end_ns"] - meta["start_ns"]
