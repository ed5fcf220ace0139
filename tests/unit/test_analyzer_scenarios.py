"""Every rule on recorded snapshots of a workload with the problem and with its fix
(tests/data/<scenario>/{problem,fixed}.json; tests/data/README.md says how each was made).

The rule must fire on the problem at the right Python line and must not fire on the fix.
"""

from __future__ import annotations

import pathlib

import pytest

from stacklens.analyzer import analyze
from stacklens.cct.export import load

DATA = pathlib.Path(__file__).resolve().parents[1] / "data"

# scenario, rule, the Python line (frame label) the finding must name in its path
CASES = [
    # recorded from real torch CPU runs (tests/targets/scenario_*.py --record)
    ("item_sync", "sync_stalls", "py:tests/targets/scenario_item_sync.py:step:29"),
    ("layout", "layout_conversions", "py:tests/targets/scenario_layout.py:step:21"),
    ("alloc_churn", "allocator_churn", "py:tests/targets/scenario_alloc_churn.py:step:25"),
    ("embedding_backward", "backward_cost", "py:tests/targets/scenario_embedding_backward.py:forward:21"),
    ("hotspot", "hotspots", "py:tests/targets/scenario_hotspot.py:step:20"),
    # recorded from real runs on an NVIDIA H200 (torch 2.11+cu130), same recorder with CUDA activity
    ("cuda_launch_bound", "launch_bound", "py:tests/targets/scenario_launch_bound.py:step:23"),
    ("cuda_kernel_fusion", "kernel_fusion", "py:tests/targets/scenario_kernel_fusion.py:gelu_layernorm:17"),
    ("cuda_h2d_copies", "host_device_copies", "py:tests/targets/scenario_h2d_copies.py:step:21"),
    ("cuda_fp32_gemm", "fp32_gemm", "py:tests/targets/scenario_fp32_gemm.py:step:19"),
    ("cuda_item_sync", "sync_stalls", "py:tests/targets/scenario_item_sync.py:step:29"),
    # recorded by stacklens itself (`stacklens profile --agent`: BPF CPU samples and operator probes,
    # the agent's Python sampler). BPF stacks carry no Python frames yet, so op-level findings name
    # the operator; Python-line findings come from the agent's samples.
    ("bpf_layout", "layout_conversions", "op:aten::contiguous"),
    ("bpf_item_sync", "sync_stalls", "op:aten::item"),
    ("bpf_alloc_churn", "allocator_churn", "op:aten::zeros"),
    ("bpf_embedding_backward", "allocator_churn", "op:aten::embedding_dense_backward"),
    ("bpf_hotspot", "hotspots", "scenario_hotspot.py:make.<locals>.step:20"),
    # stacklens' BPF probes with the backward link (issue 18): the embedding's backward charged to
    # the forward line that created it, from live data
    ("bpf_backward_linked", "backward_cost", "scenario_embedding_backward.py:Model.forward:21"),
    # SYNTHETIC GPU snapshots (tests/unit/test_analyzer_synthetic.py) until GPU recordings land
    ("gpu_kernel_fusion", "kernel_fusion", "py:tests/targets/scenario_kernel_fusion.py:gelu_layernorm:18"),
    ("gpu_launch_bound", "launch_bound", "py:tests/targets/scenario_launch_bound.py:per_item_matmuls:25"),
    ("gpu_h2d_copies", "host_device_copies", "py:tests/targets/scenario_h2d_copies.py:step:27"),
    ("gpu_fp32_gemm", "fp32_gemm", "py:tests/targets/scenario_fp32_gemm.py:forward:16"),
    ("gpu_item_sync", "sync_stalls", "py:tests/targets/scenario_item_sync.py:step:30"),
    ("gpu_alloc_churn", "allocator_churn", "py:tests/targets/scenario_alloc_churn.py:step:28"),
    ("gpu_backward_linked", "backward_cost", "py:tests/targets/scenario_embedding_backward.py:forward:25"),
]


def _names(f, line: str) -> bool:
    # Python labels of stacklens' own recordings hold absolute paths: match the tail.
    return any(label == line or label.endswith("/" + line) for label in f.path)


def _findings(scenario: str, which: str, rule: str):
    snap = load(DATA / scenario / f"{which}.json")
    return snap, [f for f in analyze(snap) if f.rule == rule]


@pytest.mark.parametrize("scenario,rule,line", CASES, ids=[c[0] for c in CASES])
def test_rule_fires_on_problem_at_the_line(scenario, rule, line):
    snap, found = _findings(scenario, "problem", rule)
    at_line = [f for f in found if _names(f, line)]
    assert at_line, f"{rule} did not name {line}; it said {[(f.title, f.path[-1:]) for f in found]}"
    f = at_line[0]
    assert f.severity in ("high", "medium")
    assert f.fix and f.title and f.evidence
    if rule != "hotspots":
        assert f.estimated_saving > 0.02
    # Evidence never claims a metric the recording did not measure.
    for metric in snap.unavailable:
        assert metric not in f.evidence


@pytest.mark.parametrize("scenario,rule,line", CASES, ids=[c[0] for c in CASES])
def test_rule_quiet_on_fixed(scenario, rule, line):
    _, found = _findings(scenario, "fixed", rule)
    if rule == "hotspots":
        # Something is always the hottest line; the fixed run must not point at the removed one.
        assert not [f for f in found if _names(f, line)]
    else:
        assert found == [], [(f.title, f.path[-1:]) for f in found]


def test_recorded_snapshots_are_labelled():
    for scenario, _, _ in CASES:
        for which in ("problem", "fixed"):
            meta = load(DATA / scenario / f"{which}.json").meta
            assert meta["synthetic"] is scenario.startswith("gpu_"), (scenario, which)
            assert meta["fixed"] is (which == "fixed")
