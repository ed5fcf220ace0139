"""benchmarks/gpu/check_detach.py without a GPU: it answers --help without torch or stacklens, and
its checks read a recorded process the way acceptance 2 asks (the GPU run is its own)."""

import copy
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu" / "check_detach.py"


@pytest.fixture(scope="module")
def cd():
    spec = importlib.util.spec_from_file_location("check_detach", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def run(median_s, **extra):
    return {"run": {"median_s": median_s}, **extra}


FINALIZED = "info: cupti finalized: CUPTI's API hooks are out of the process"
SKIPPED = "info: CUPTI finalize skipped: the user's profiler holds CUPTI's subscriber (…)"
GOOD = {"workload": "launch", "variant": "finalize", "phases": {
    "unprofiled": {"median_s": 0.00700},
    "attach1": run(0.0090, teardown=FINALIZED, kernels=150_000),
    "after1": {"median_s": 0.00705}, "after1_2s": {"median_s": 0.00701},
    "graph": {"captured_before": True, "captured_now": True},
    "attach2": run(0.0090, teardown=FINALIZED, kernels=149_000), "after2": {"median_s": 0.00712},
    "torchprof": {"seq_kernels": 100, "seq_expected": 100, "step_kernels": 10_000, "step_expected": 10_000},
    "after_torchprof": {"median_s": 0.0075}, "attach3": run(0.0091, teardown=SKIPPED, kernels=10),
    "graph_end": {"captured_before": True, "captured_now": True},
}}


def test_help_needs_neither_torch_nor_stacklens():
    out = subprocess.run([sys.executable, "-S", str(SCRIPT), "--help"], capture_output=True, text=True,
                         timeout=60, cwd="/")
    assert out.returncode == 0 and "acceptance 2" in out.stdout and "--cpu-smoke" in out.stdout


def test_a_process_left_as_it_was_passes_every_check(cd):
    rec = copy.deepcopy(GOOD)
    checks = cd.evaluate(rec)
    assert checks and all(c["pass"] for c in checks), [c for c in checks if not c["pass"]]
    assert rec["ratios"]["after1"] == pytest.approx(1.0071, abs=1e-4)
    assert "| launch | finalize | 7.000 |" in cd.markdown([dict(rec, checks=checks)])


@pytest.mark.parametrize("path, value, failing", [
    (("after1", "median_s"), 0.00720, "after1 <= 1.02x unprofiled"),
    (("attach1", "teardown"), "info: CUPTI finalize skipped: CUDA < 12.6 (…)", "attach1: cupti finalized"),
    (("attach2", "kernels"), 0, "attach2: a second attach records kernels"),
    (("torchprof", "seq_kernels"), 97, "every kernel of the known sequence"),
    (("graph", "captured_before"), False, "graph: CUDA graphs replay"),
])
def test_each_way_of_leaving_the_process_changed_fails_its_check(cd, path, value, failing):
    rec = copy.deepcopy(GOOD)
    rec["phases"][path[0]][path[1]] = value
    bad = [c["check"] for c in cd.evaluate(rec) if not c["pass"]]
    assert len(bad) == 1 and failing in bad[0], bad


def test_the_variants_it_compares_against_are_recorded_not_held_to_acceptance_2(cd):
    rec = copy.deepcopy(GOOD)
    rec["variant"] = "no_finalize"
    rec["phases"]["after1"]["median_s"] = 0.0080          # CUPTI's hooks stay: slower after detach
    rec["phases"]["attach1"]["teardown"] = "info: CUPTI left initialised at detach (gpu_finalize off)"
    assert all(c["pass"] for c in cd.evaluate(rec)) and rec["ratios"]["after1"] == pytest.approx(1.1429, abs=1e-4)
