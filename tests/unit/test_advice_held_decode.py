"""Advice on a held session's decode profile (issues 41 and 44): the snapshot carries its window,
so the launch-bound finding is first and names the decode loop's line. No GPU needed.

tests/data/gpu_run37/decode_held.json.gz: batch-1 greedy decoding of transformers'
GPT2LMHeadModel (random weights) on an NVIDIA H200 (run 37, benchmarks/gpu/daemon_windows.py part
2), `stacklens attach --agent` through stacklensd, 20 s, `stacklens report -f json`; paths
relativized. On landed main before (ab3d3c1) a held session's snapshot had no window, the
analyzer took the busiest thread's CPU time as its length, and the same kind of job got no
launch-bound finding at all.
"""

from __future__ import annotations

import pathlib

from stacklens.analyzer import analyze
from stacklens.analyzer.view import View
from stacklens.cct.export import load

DATA = pathlib.Path(__file__).resolve().parents[1] / "data" / "gpu_run37" / "decode_held.json.gz"
LOOP = "tests/targets/safety_workloads.py:Decode.episode:160"     # r = self.model(ids, past_key_values=…)


def test_the_held_decode_profile_carries_its_window():
    snap = load(DATA)
    view = View(snap)
    assert view.wall_source == "meta.window_s" and 20e9 <= view.wall_ns <= 21e9


def test_launch_bound_is_first_and_names_the_decode_loop_and_cuda_graphs():
    snap = load(DATA)
    top = analyze(snap)[0]
    assert top.rule == "launch_bound" and top.severity == "high", top.title
    assert top.path[-1] == f"py:{LOOP}", top.path
    assert "reduce-overhead" in top.fix and "CUDA graphs" in top.fix
    assert top.evidence["gpu_busy_share"] < 0.1 and top.evidence["top_line_idle_share"] > 0.9
    assert 0.5 < top.estimated_saving < 1.0          # an upper bound, said in the fix
    assert "upper bound" in top.fix
