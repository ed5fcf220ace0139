"""benchmarks/gpu/gemm_speedups.py and advice_check.py without a GPU (issue 44): --help needs no
torch; the --cpu-smoke runs write what the analyzer and the comparison read; the estimate tree
fires each case's rule; the comparison judges estimate vs measured."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from stacklens.analyzer.rules._speedups import load_table

REPO = Path(__file__).resolve().parents[2]
GPU = REPO / "benchmarks" / "gpu"
TABLE = REPO / "tests" / "data" / "gemm_speedups" / "table.json"
DECODE = REPO / "tests" / "data" / "gpu_run31" / "decode.json.gz"
SIMT = "void cutlass::Kernel2<cutlass_80_simt_sgemm_128x64_8x5_nn_align1>(cutlass_80_simt_sgemm_128x64_8x5_nn_align1::Params)"


@pytest.fixture(scope="module")
def ac():
    spec = importlib.util.spec_from_file_location("advice_check", GPU / "advice_check.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def run(script: str, *args: str, site: bool = True) -> subprocess.CompletedProcess:
    cmd = [sys.executable, *([] if site else ["-S"]), str(GPU / script), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=REPO)


@pytest.mark.parametrize("script", ["gemm_speedups.py", "advice_check.py"])
def test_help_needs_no_torch(script):
    out = run(script, "--help", site=False)
    assert out.returncode == 0 and "--cpu-smoke" in out.stdout, out.stderr


def test_gemm_smoke_table_has_the_schema_the_analyzer_reads(tmp_path):
    pytest.importorskip("torch")
    out = tmp_path / "g.json"
    r = run("gemm_speedups.py", "--cpu-smoke", "--out", str(out))
    assert r.returncode == 0, r.stderr[-2000:]
    data = json.loads(out.read_text())
    assert data["meta"]["cpu_smoke"] is True and data["rows"]
    row = data["rows"][0]
    assert set(row["modes"]) == {"fp32", "tf32", "bf16"} and set(row["speedup"]) <= {"tf32", "bf16"}
    assert all(m["ms"] > 0 and m["kernels"] for m in row["modes"].values())
    assert load_table(out).rows == ()                  # a smoke table is never used...
    data["meta"]["cpu_smoke"] = False
    real = tmp_path / "as_if_measured.json"
    real.write_text(json.dumps(data))
    assert len(load_table(real).rows) == len([r for r in data["rows"] if r["speedup"].get("tf32")])   # ...but parses


def test_advice_smoke_writes_cases_and_the_table(tmp_path):
    pytest.importorskip("torch")
    out = tmp_path / "a.json"
    r = run("advice_check.py", "--cpu-smoke", "--cases", "tf32_resnet50,sync_item", "--out", str(out))
    assert r.returncode == 0, r.stderr[-2000:]
    doc = json.loads(out.read_text())
    assert doc["format"] == "stacklens.advice_check" and set(doc["cases"]) == {"tf32_resnet50", "sync_item"}
    for rec in doc["cases"].values():
        assert "error" not in rec, rec.get("traceback")
        assert rec["measured_speedup"] > 0 and "error" not in rec["estimate"]
    assert "| tf32_resnet50 | fp32_gemm |" in out.with_suffix(".md").read_text()


def test_the_estimate_tree_fires_each_rule(ac):
    gemm = {SIMT: ["kernel", 120e3, 20], "gelu_kernel": ["kernel", 60e3, 400]}
    e = ac.tree_estimate("fp32_gemm", [{"func": "train_step", "line": 1, "kernels": gemm}], 200e6, str(TABLE))
    assert e["fired"] and not e["guessed"]                          # 6 ms launches: the table's 3.0x
    assert e["estimated_saving"] == pytest.approx(120 * (1 - 1 / 3.0) / 200, abs=1e-3)
    small = {f"k{i}": ["kernel", 64 * 3.0, 64] for i in range(200)}  # 64 tokens, 200 kernels of 3 µs each
    e = ac.tree_estimate("launch_bound", [{"func": "eager_decode", "line": 1, "kernels": small, "cpu_ns": 64 * 5.7e6}],
                         64 * 6e6, "")
    assert e["fired"] and e["upper_bound"] and e["estimated_speedup"] > 5
    e = ac.tree_estimate("sync_stalls", [{"func": "train_step", "line": 1, "kernels": {SIMT: ["kernel", 35e3, 500]}},
                                         {"func": "with_item", "line": 2, "kernels": {}, "sync_wait_ns": 15e6}], 50e6, "")
    assert e["fired"] and "with_item" in e["title"]


def test_compare_judges_estimates_from_the_run_and_from_a_recorded_profile(ac):
    measured = {"meta": {"device": "test"}, "cases": {
        "tf32_gpt2": {"rule": "fp32_gemm", "measured_speedup": 1.9,
                      "estimate": {"rule": "fp32_gemm", "fired": True, "estimated_speedup": 1.7, "upper_bound": False}},
        "graphs_decode": {"rule": "launch_bound", "measured_speedup": 3.0},
        "sync_item": {"rule": "sync_stalls", "skipped": "budget of 150 s spent"}}}
    rows = ac.compare(measured, {"graphs_decode": str(DECODE)}, "")
    by = {(r["case"], r["source"].split()[0]): r for r in rows}
    assert by[("tf32_gpt2", "rule")]["verdict"] == "within 25%" and by[("tf32_gpt2", "rule")]["ratio"] == pytest.approx(1.118, abs=1e-3)
    decode = by[("graphs_decode", "stacklens")]                 # run 31's recording: 0.92 saving, an upper bound
    assert decode["upper_bound"] and decode["estimated"] > 3.0 and decode["verdict"] == "below the upper bound"
    assert by[("sync_item", "-")]["verdict"] == "budget of 150 s spent"
    text = ac.markdown(rows, measured["meta"])
    assert "| graphs_decode | launch_bound | stacklens profile decode.json.gz |" in text and "(upper bound)" in text
