"""Acceptance 2: libtorch operator probes (one uprobe_multi link) + CPU samples on a torch MLP."""

from __future__ import annotations

import os

import pytest

from stacklens.bpf import ProbeConfig, ProbeSession

pytestmark = pytest.mark.bpf
torch = pytest.importorskip("torch")


def _own_uprobe_multi_links() -> int:
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            with open(f"/proc/self/fdinfo/{fd}") as f:
                if "uprobe_multi" in f.read():
                    n += 1
        except OSError:
            pass
    return n


def test_op_paths_nested_and_counted(bpf_ok, start_target):
    t = start_target("torch_mlp.py")
    before = _own_uprobe_multi_links()
    s = ProbeSession(t.pid, ProbeConfig(cpu_sample_hz=0))
    report = s.attach()
    try:
        torch_libs = [lib for lib in report.libraries if lib.role == "torch"]
        assert len(torch_libs) == 1 and torch_libs[0].probes > 1000
        assert any("not applicable" in n and "libcuda" in n for n in report.notes)
        assert _own_uprobe_multi_links() == before + 1  # all op probes are one link
        t.send("go 10")
        t.readline()
        counts = s.op_counts()
    finally:
        s.detach()
    assert _own_uprobe_multi_links() == before
    # two Linear layers x 10 steps: linear -> addmm, nested
    assert counts[("aten::linear",)] == 20
    assert counts[("aten::linear", "aten::addmm")] == 20
    assert counts[("aten::relu",)] == 10
    assert counts[("aten::relu", "aten::clamp_min")] == 10
    assert counts[("aten::mse_loss",)] == 10
    # a returned op never stays on the stack: addmm never appears under relu or mse_loss
    assert not any(p[0] in ("aten::relu", "aten::mse_loss") and "aten::addmm" in p for p in counts)
    # every path's prefix is itself a counted path (entries nest properly)
    for p in counts:
        assert len(p) == 1 or p[:-1] in counts, p
    assert s.stats()["op_overflow"] == 0


def test_events_stop_after_detach(bpf_ok, start_target):
    t = start_target("torch_mlp.py")
    s = ProbeSession(t.pid, ProbeConfig(cpu_sample_hz=0))
    s.attach()
    t.send("go 5")
    t.readline()
    calls = s.stats()["op_calls"]
    assert calls > 100
    s.detach()
    s.detach()  # idempotent
    assert s.poll(10) == [] and s.op_counts() == {}
    t.send("go 5")
    t.readline()  # runs fine without probes


def test_cpu_samples_carry_op_path_and_stack(bpf_ok, start_target):
    t = start_target("torch_mlp.py")
    s = ProbeSession(t.pid, ProbeConfig(cpu_sample_hz=499))
    s.attach()
    try:
        t.send("go 3000")
        events = []
        import select
        while not select.select([t.proc.stdout], [], [], 0)[0]:
            events.extend(s.poll(50))
        t.readline()
        events.extend(s.poll(50))
        counts = s.op_counts()
        stats = s.stats()
    finally:
        s.detach()
    samples = [e for e in events if e.kind == "cpu_sample"]
    assert len(samples) > 20, stats
    assert all(e.pid == t.pid for e in samples)
    assert all(e.native_stack for e in samples)
    with_ops = [e for e in samples if e.op_path]
    assert with_ops, "no sample landed inside an operator"
    for e in with_ops:
        assert e.op_path in counts or e.op_path == ("[unknown op path]",), e.op_path
    assert stats["lost_samples"] == 0 and stats["drops"] == 0
