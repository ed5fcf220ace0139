"""Acceptance 3: bad input gives a clear error or a clear "not applicable"; nothing stays attached."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from stacklens.bpf import ProbeConfig, ProbeSession
from stacklens.bpf.shared import POOL
from stacklens.errors import InputError, NoSuchProcess

from tests.bpf.conftest import TARGETS, poll_until

pytestmark = pytest.mark.bpf


def _bpf_fds() -> dict[str, int]:
    """Our own BPF objects: uprobe_multi links, programs, perf events (for leak checks), once
    the compiled programs no process uses are closed (bpf/shared.py keeps them for the next
    attach: loaded, attached to nothing)."""
    POOL.close_idle()
    out = {"links": 0, "progs": 0, "perf": 0}
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
            with open(f"/proc/self/fdinfo/{fd}") as f:
                info = f.read()
        except OSError:
            continue
        if "bpf_link" in target and "uprobe_multi" in info:
            out["links"] += 1
        elif "bpf-prog" in target:
            out["progs"] += 1
        elif "perf_event" in target:
            out["perf"] += 1
    return out


def test_no_such_pid(bpf_ok):
    before = _bpf_fds()
    pid = 2 ** 22 + 12345  # above pid_max's default range
    with pytest.raises(NoSuchProcess, match="no process"):
        ProbeSession(pid).attach()
    with pytest.raises(InputError):
        ProbeSession(-5).attach()
    assert _bpf_fds() == before


def test_pid_exits_during_attach(bpf_ok, fake_libs):
    before = _bpf_fds()
    p = subprocess.Popen([sys.executable, str(TARGETS / "fake_cuda_late.py"), str(fake_libs["dir"]), "exit"],
                         stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "ready"
        s = ProbeSession(p.pid, ProbeConfig(cpu_sample_hz=99))
        with pytest.raises(NoSuchProcess, match="exited|no process"):
            s.attach()  # compiling takes longer than the 0.3 s the target lives
        assert not s.attached
    finally:
        p.kill()
        p.wait()
        p.stdout.close()
    assert _bpf_fds() == before


def test_no_gpu_library_cpu_sampling_still_applies(bpf_ok, fake_libs, start_target):
    t = start_target("fake_cuda_late.py", str(fake_libs["dir"]))
    before = _bpf_fds()
    s = ProbeSession(t.pid, ProbeConfig(cpu_sample_hz=99, rescan_interval_s=0))
    report = s.attach()
    try:
        assert report.libraries == ()
        assert any("GPU API probes: not applicable" in n for n in report.notes)
        assert any("operator probes: not applicable" in n for n in report.notes)
        assert report.cpu_sampling_hz == 99
    finally:
        s.detach()
    assert _bpf_fds() == before


def test_library_without_symbols(bpf_ok, fake_libs, start_target):
    t = start_target("fake_cuda_late.py", str(fake_libs["dir"]), "nosyms")
    s = ProbeSession(t.pid, ProbeConfig(cpu_sample_hz=0))
    report = s.attach()
    try:
        assert [(lib.role, lib.probes) for lib in report.libraries] == [("cuda", 0)]
        assert any("exports none of the" in n for n in report.notes)
        assert s.stats()["links"] == 0
    finally:
        s.detach()


def test_library_loaded_after_attach_is_picked_up(bpf_ok, fake_libs, start_target):
    t = start_target("fake_cuda_late.py", str(fake_libs["dir"]))
    s = ProbeSession(t.pid, ProbeConfig(cpu_sample_hz=0, rescan_interval_s=0.2))
    s.attach()
    try:
        t.send("load")
        assert t.readline() == "loaded"
        import time
        time.sleep(0.3)
        s.poll(10)  # rescans
        assert [(lib.role, lib.probes > 20) for lib in s.libraries] == [("cuda", True)]
        t.send("go 9")
        assert t.readline() == "done"
        evs = poll_until(s, lambda e: len(e) >= 9, 5)
    finally:
        s.detach()
    assert len([e for e in evs if e.api == "cuLaunchKernel"]) == 9
    assert evs[0].kernel_name == "unresolved:0x0"
