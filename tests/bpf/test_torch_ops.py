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
        # all op probes are one link, the backward link's two autograd entries another
        assert _own_uprobe_multi_links() == before + 2
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
    assert stats["lost_samples"] == 0 and stats["drops"] == 0, stats


def _ten_steps(t, config: ProbeConfig):
    s = ProbeSession(t.pid, config)
    report = s.attach()
    try:
        t.send("go 10")
        t.readline()
        return report, s.op_counts()
    finally:
        s.detach()


def test_view_ops_skipped_by_default_all_ops_sees_them(bpf_ok, start_target):
    from stacklens.bpf.ops import VIEW_OPS

    t = start_target("torch_mlp.py")
    default, counts = _ten_steps(t, ProbeConfig(cpu_sample_hz=0, gpu=False))
    every, all_counts = _ten_steps(t, ProbeConfig(cpu_sample_hz=0, gpu=False, all_ops=True))
    n_default = sum(lib.probes for lib in default.libraries if lib.role == "torch")
    n_all = sum(lib.probes for lib in every.libraries if lib.role == "torch")
    assert n_all - n_default == len(VIEW_OPS)  # every listed op exists in this libtorch
    # default: no view/metadata op anywhere in any path; the ops around them are unchanged
    assert not {op for p in counts for op in p} & VIEW_OPS
    assert counts[("aten::linear",)] == 20 and counts[("aten::linear", "aten::addmm")] == 20
    assert not any("aten::t" in p or "aten::as_strided" in p for p in counts)
    # all_ops: the same steps show them (linear transposes its weight: aten::t under aten::linear)
    assert all_counts[("aten::linear", "aten::t")] == 20
    assert any(p[-1] == "aten::as_strided" for p in all_counts)
    assert all_counts[("aten::linear",)] == 20 and all_counts[("aten::linear", "aten::addmm")] == 20
    # the calls the default set no longer sees are exactly the view/metadata ones (torch 2.13:
    # 92 op calls per step with all ops, 43 without the 49 view/metadata calls)
    skipped = sum(n for p, n in all_counts.items() if p[-1] in VIEW_OPS)
    assert sum(all_counts.values()) - sum(counts.values()) == skipped
    assert skipped > sum(counts.values()) / 2
    # an explicit op_filter picks from every op, view ops included
    _, only_t = _ten_steps(t, ProbeConfig(cpu_sample_hz=0, gpu=False, op_filter=r"^aten::t$"))
    assert set(only_t) == {("aten::t",)} and only_t[("aten::t",)] >= 20
