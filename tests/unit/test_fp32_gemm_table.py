"""The fp32_gemm rule's saving from a measured GEMM speedup table (issue 44), else its guessed
factor, said to be a guess. No GPU: synthetic GPU-bound snapshots and a small table fixture
(tests/data/gemm_speedups/table.json, made-up numbers in the format benchmarks/gpu/gemm_speedups.py
writes)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from stacklens.analyzer import analyze
from stacklens.analyzer.rules._speedups import kernel_family, load_table
from stacklens.analyzer.rules.gemm import TF32_SPEEDUP
from stacklens.cct import CCT, METRICS, Frame
from stacklens.errors import InputError

TABLE = Path(__file__).resolve().parents[1] / "data" / "gemm_speedups" / "table.json"
SIMT = "void cutlass::Kernel2<cutlass_80_simt_sgemm_128x64_8x5_nn_align1>(cutlass_80_simt_sgemm_128x64_8x5_nn_align1::Params)"
UNKNOWN = "ampere_sgemm_64x32_sliced1x4_nn"


def gpu_bound(gemms: dict[str, tuple[int, int]]):
    """A 10 s window, the GPU busy 9.5 s: `gemms` (name -> (GPU ns, launches)) and a GELU for
    the rest; the GEMM time a fix removes comes off the window in full."""
    t = CCT(METRICS)
    fwd = (Frame.python("train.py", "main", 5), Frame.python("train.py", "step", 20))
    for name, (ns, n) in gemms.items():
        t.add_many(fwd + (Frame.op("aten::mm"), Frame.api("cuLaunchKernel"), Frame.kernel(name)),
                   {"launch_count": n, "kernel_count": n, "gpu_time_ns": ns})
    rest = 9_500_000_000 - sum(ns for ns, _ in gemms.values())
    t.add_many(fwd + (Frame.op("aten::gelu"), Frame.api("cuLaunchKernel"), Frame.kernel("gelu_kernel")),
               {"launch_count": 1000, "kernel_count": 1000, "gpu_time_ns": rest})
    t.add(fwd, "cpu_samples", 100)
    return t.snapshot(meta={"duration_s": 10.0, "synthetic": True})


def gemm_finding(snap, table):
    (f,) = [f for f in analyze(snap, {"rules": {"fp32_gemm": {"speedup_table": str(table)}}}) if f.rule == "fp32_gemm"]
    return f


def test_the_tables_factor_for_the_kernel_and_its_size_class_is_used_and_named():
    f = gemm_finding(gpu_bound({SIMT: (6_000_000_000, 1000)}), TABLE)      # 6 ms a launch: the 6 ms row
    assert f.estimated_saving == pytest.approx(6.0 * (1 - 1 / 3.0) / 10.0, abs=1e-3)
    assert f.evidence["tf32_speedup"] == pytest.approx(3.0) and f.evidence["tf32_measured_share"] == 1.0
    assert "measured for each kernel and size" in f.fix and str(TABLE) in f.fix and "NVIDIA H200" in f.fix
    assert "guess" not in f.fix


def test_a_smaller_call_of_the_same_kernel_takes_its_own_size_class():
    f = gemm_finding(gpu_bound({SIMT: (1_000_000_000, 10_000)}), TABLE)    # 0.1 ms a launch
    assert f.evidence["tf32_speedup"] == pytest.approx(1.5)


def test_another_tile_of_the_same_family_matches_by_family():
    other_tile = "void cutlass::Kernel2<cutlass_80_simt_sgemm_256x128_8x4_nn_align1>(cutlass_80_simt_sgemm_256x128_8x4_nn_align1::Params)"
    assert kernel_family(other_tile) == kernel_family(SIMT) == "cutlass_80_simt_sgemm_nn"
    f = gemm_finding(gpu_bound({other_tile: (6_000_000_000, 1000)}), TABLE)
    assert f.evidence["tf32_speedup"] == pytest.approx(3.0)


@pytest.mark.parametrize("table", ["", "/nonexistent/gemm_speedups.json"])
def test_without_a_table_the_factor_is_said_to_be_a_guess(table):
    f = gemm_finding(gpu_bound({SIMT: (6_000_000_000, 1000)}), table)
    assert f.estimated_saving == pytest.approx(6.0 * (1 - 1 / TF32_SPEEDUP) / 10.0, abs=1e-3)
    assert "a guessed factor, not yet checked against the speedup of applying the fix" in f.fix
    assert "1.83x" in f.fix and f.evidence["tf32_measured_share"] == 0.0


def test_a_kernel_the_table_lacks_is_guessed_and_the_table_named():
    f = gemm_finding(gpu_bound({UNKNOWN: (6_000_000_000, 1000)}), TABLE)
    assert f.evidence["tf32_speedup"] == pytest.approx(TF32_SPEEDUP, abs=1e-3)
    assert "guessed factor" in f.fix and f"{TABLE} has no row for these kernels" in f.fix


def test_a_row_without_a_tf32_time_is_no_row():
    # the fixture's `ampere_sgemm_128x64_nt` row has an fp32 time but TF32 failed: never a factor
    assert load_table(TABLE).tf32("ampere_sgemm_128x64_nt", 2e6) is None


def test_measured_and_guessed_parts_are_each_said():
    f = gemm_finding(gpu_bound({SIMT: (3_000_000_000, 500), UNKNOWN: (3_000_000_000, 500)}), TABLE)
    saved = 3.0 * (1 - 1 / 3.0) + 3.0 * (1 - 1 / TF32_SPEEDUP)
    assert f.estimated_saving == pytest.approx(saved / 10.0, abs=1e-3)
    assert f.evidence["tf32_measured_share"] == pytest.approx(0.5)
    assert "measured for 50% of these GEMMs' GPU time" in f.fix and "the other 50%" in f.fix and "guessed" in f.fix


def test_a_configured_factor_overrides_the_table():
    snap = gpu_bound({SIMT: (6_000_000_000, 1000)})
    found = analyze(snap, {"rules": {"fp32_gemm": {"speedup_table": str(TABLE), "tf32_speedup": 2.0}}})
    (f,) = [f for f in found if f.rule == "fp32_gemm"]
    assert f.evidence["tf32_speedup"] == pytest.approx(2.0) and "the configured tf32_speedup" in f.fix


def test_a_cpu_smoke_table_is_never_used(tmp_path):
    data = json.loads(TABLE.read_text())
    data["meta"]["cpu_smoke"] = True
    p = tmp_path / "smoke.json"
    p.write_text(json.dumps(data))
    assert load_table(p).rows == ()
    assert "guessed factor" in gemm_finding(gpu_bound({SIMT: (6_000_000_000, 1000)}), p).fix


def test_a_file_that_is_not_a_table_is_an_input_error_naming_it(tmp_path):
    for i, text in enumerate(('{"format": "something else"}', "not json")):
        bad = tmp_path / f"t{i}.json"
        bad.write_text(text)
        with pytest.raises(InputError) as e:
            load_table(bad)
        assert f"{bad}: not a GEMM speedup table" in str(e.value) and "gemm_speedups.py" in str(e.value)


def test_kernel_families_drop_tile_stage_and_alignment_sizes():
    xmma = ("sm80_xmma_gemm_f32f32_f32f32_f32_tn_n_tilesize32x32x8_stage3_warpsize1x2x1_ffma_aligna4_alignc4"
            "_execute_kernel__5x_cublas")
    assert kernel_family(xmma) == "sm80_xmma_gemm_f32f32_f32f32_f32_tn_n_ffma_execute_kernel_5x_cublas"
    gemv = ("std::enable_if<!(false), void>::type internal::gemvx::kernel<int, int, float, float, float, float, "
            "false, true, true, false, 7, false, cublasGemvParamsEx<int, float> >(cublasGemvParamsEx<int, float>)")
    assert kernel_family(gemv) == "internal::gemvx::kernel"
