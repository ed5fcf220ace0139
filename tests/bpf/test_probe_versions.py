"""Probes attach to every exported version of their call (cuCtxSynchronize_v2, _ptsz, _ptds) on
the fake libcuda, and one call is one event even where the legacy name wraps the new one."""

from __future__ import annotations

import pytest

from stacklens.bpf import ProbeConfig, ProbeSession
from stacklens.bpf.spec import load_specs, resolve_library
from stacklens.daemon.join.joiner import Joiner

from tests.bpf.conftest import poll_until
from tests.bpf.test_fake_gpu import assert_sync_times, parse_slept

pytestmark = pytest.mark.bpf
ROUNDS = 3
SYNC_US = 20000
# the fake's versioned exports and the probe each belongs to (tests/fakes/fake_cuda.c)
VERSIONED = {
    "cuCtxSynchronize_v2": "cuCtxSynchronize",
    "cuStreamSynchronize_ptsz": "cuStreamSynchronize",
    "cuLaunchKernel_ptsz": "cuLaunchKernel",
    "cuMemcpyHtoD_v2_ptds": "cuMemcpyHtoD_v2",
    "cuMemcpyHtoDAsync_v2_ptsz": "cuMemcpyHtoDAsync_v2",
}


def test_every_versioned_export_of_the_fake_is_probed(fake_libs):
    res = resolve_library(fake_libs["cuda"], [s for s in load_specs() if "libcuda" in s.library])
    sites = {s.export: s.spec.symbol for s in res.sites}
    for export, probe in VERSIONED.items():
        assert sites.get(export) == probe, (export, res.summary())
    assert sites["cuCtxSynchronize"] == "cuCtxSynchronize"  # the legacy name too
    assert "cuMemcpyHtoD" not in sites  # 32-bit ABI: another call


def test_versioned_calls_are_measured_once_each(bpf_ok, fake_libs, start_target):
    t = start_target("fake_cuda_versions.py", str(fake_libs["dir"]), str(ROUNDS),
                     env={"FAKE_SYNC_US": str(SYNC_US)})
    s = ProbeSession(t.pid, ProbeConfig(cpu_sample_hz=0))
    report = s.attach()
    try:
        t.send()
        done = t.readline()
        assert done.startswith("done ")
        evs = poll_until(s, lambda e: sum(x.kind == "sync" for x in e) >= 3 * ROUNDS
                         and sum(x.kind == "memcpy" for x in e) >= 2 * ROUNDS)
        evs += s.poll(timeout_ms=200)  # anything counted twice would be here by now
    finally:
        s.detach()
    (lib,) = report.libraries
    for export, probe in VERSIONED.items():
        assert (probe, export) in lib.sites
    assert any("cuCtxSynchronize -> cuCtxSynchronize, cuCtxSynchronize_v2" in n for n in report.notes), report.notes

    sync = [e for e in evs if e.kind == "sync"]
    # _v2, the legacy wrapper (its nested _v2 entry replaces the outer call's pending entry in
    # BPF: one event, not two) and _ptsz, each round; events carry the probe's name
    assert sorted(e.api for e in sync) == sorted(["cuCtxSynchronize"] * 2 * ROUNDS + ["cuStreamSynchronize"] * ROUNDS)
    assert_sync_times(sync, parse_slept(done), floor_us=SYNC_US)
    launches = [e for e in evs if e.kind == "launch"]
    assert len(launches) == ROUNDS and launches[0].api == "cuLaunchKernel" and launches[0].args["f"] == 0xABC
    copies = sorted((e.api, e.bytes) for e in evs if e.kind == "memcpy")
    assert copies == sorted([("cuMemcpyHtoD_v2", 4096), ("cuMemcpyHtoDAsync_v2", 256)] * ROUNDS)

    j = Joiner(t.pid, agent=False)
    for e in evs:
        j.on_bpf(e)
    snap = j.snapshot()
    assert abs(snap.total("sync_wait_ns") - 3 * ROUNDS * SYNC_US * 1000) <= 0.3 * 3 * ROUNDS * SYNC_US * 1000
