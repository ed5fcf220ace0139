"""Synthetic GPU snapshots for the GPU-only rules, and the tests that check the committed copies.

SYNTHETIC: these trees are built by hand to the shape the stacklens join produces on a GPU
(py → op → native → api:cuLaunchKernel → kernel:…), with plausible values. They stand in until
the same scenarios (tests/targets/scenario_*.py) are recorded on the GPU machine; see
tests/data/README.md. Regenerate the committed files with

    .venv/bin/python -m tests.unit.test_analyzer_synthetic --write
"""

from __future__ import annotations

import json
import pathlib
import sys

import pytest

from stacklens.cct import CCT, METRICS, Frame
from stacklens.cct.export import from_json, to_json

DATA = pathlib.Path(__file__).resolve().parents[1] / "data"
META = {"synthetic": True, "recorder": "tests/unit/test_analyzer_synthetic.py (hand-built, not a recording)"}
WALL_NS = 10_000_000_000  # 10 s window

PY_MAIN = Frame.python("tests/targets/{s}.py", "main", 60)
TORCH_LIB = "libtorch_cuda.so"
LAUNCH = Frame.api("cuLaunchKernel")


def py(s: str, func: str, line: int) -> Frame:
    return Frame.python(f"tests/targets/{s}.py", func, line)


def launches(t: CCT, prefix, op, kernel, n, gpu_ns_each, api_ns_each=4_000):
    path = prefix + (Frame.op(op), Frame.native(TORCH_LIB, "at::native::launch"), LAUNCH)
    t.add_many(path, {"api_cpu_ns": n * api_ns_each})
    t.add_many(path + (Frame.kernel(kernel),), {"launch_count": n, "kernel_count": n, "gpu_time_ns": n * gpu_ns_each})


def cpu(t: CCT, prefix, samples):
    t.add(prefix, "cpu_samples", samples)


def base(s: str):
    t = CCT(METRICS)
    main = (PY_MAIN._replace(file=f"tests/targets/{s}.py"),)
    step = main + (py(s, "step", 30),)
    # A healthy model part every scenario shares: one big GEMM on tensor cores.
    fwd = main + (py(s, "step", 20),)
    launches(t, fwd, "aten::mm", "sm80_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x32", 10_000, 400_000, 5_000)
    cpu(t, fwd + (Frame.op("aten::mm"),), 500)
    return t, main, step


def kernel_fusion(fixed: bool):
    s = "scenario_kernel_fusion"
    t, main, step = base(s)
    line = main + (py(s, "gelu_layernorm", 18),)
    if fixed:
        launches(t, line, "aten::native_layer_norm", "triton_per_fused_add_gelu_layer_norm_0", 10_000, 30_000)
    else:
        for op, k in (
            ("aten::mul", "vectorized_elementwise_kernel<4, MulFunctor<float>>"),
            ("aten::pow", "vectorized_elementwise_kernel<4, pow_tensor_scalar_kernel>"),
            ("aten::add", "vectorized_elementwise_kernel<4, CUDAFunctor_add<float>>"),
            ("aten::tanh", "vectorized_elementwise_kernel<4, tanh_kernel_cuda>"),
            ("aten::mean", "reduce_kernel<512, 1, ReduceOp<float, MeanOps>>"),
            ("aten::sub", "vectorized_elementwise_kernel<4, CUDAFunctor_sub<float>>"),
            ("aten::rsqrt", "vectorized_elementwise_kernel<4, rsqrt_kernel_cuda>"),
        ):
            launches(t, line, op, k, 50_000, 9_000)
        cpu(t, line, 900)
    return t


def launch_bound(fixed: bool):
    s = "scenario_launch_bound"
    t, main, step = base(s)
    line = main + (py(s, "per_item_matmuls", 25),)
    if fixed:
        launches(t, line, "aten::bmm", "ampere_bf16_s16816gemm_bf16_128x64_ldg8_f2f_tn", 10_000, 60_000, 6_000)
    else:
        launches(t, line, "aten::mm", "ampere_bf16_s16816gemm_bf16_64x64_sliced1x2_ldg8_f2f_tn", 640_000, 2_500, 6_000)
        cpu(t, line, 3_000)
    return t


def h2d_copies(fixed: bool):
    s = "scenario_h2d_copies"
    t, main, step = base(s)
    line = main + (py(s, "step", 27),)
    to = (Frame.op("aten::to_dtype_layout"), Frame.op("aten::_to_copy"), Frame.op("aten::copy_"),
          Frame.native(TORCH_LIB, "at::native::copy_kernel_cuda"))
    if fixed:
        t.add_many(line + to + (Frame.api("cuMemcpyHtoDAsync_v2"),),
                   {"api_cpu_ns": 10_000 * 8_000, "copy_bytes": 10_000 * 2 * 2**20})
    else:
        t.add_many(line + to + (Frame.api("cuMemcpyHtoD_v2"),),
                   {"api_cpu_ns": 10_000 * 250_000, "copy_bytes": 10_000 * 2 * 2**20, "sync_wait_ns": 10_000 * 40_000})
        cpu(t, line + to, 2_500)
    return t


def fp32_gemm(fixed: bool):
    s = "scenario_fp32_gemm"
    t, main, step = base(s)
    line = main + (py(s, "forward", 16),)
    k = ("cutlass_80_tensorop_s1688gemm_128x128_32x3_nn_align4" if fixed else "ampere_sgemm_128x64_nn")
    launches(t, line, "aten::addmm", k, 10_000, 120_000 if fixed else 450_000)
    return t


def gpu_item_sync(fixed: bool):
    s = "scenario_item_sync"
    t, main, step = base(s)
    line = main + (py(s, "step", 30),)
    n = 10_000 if fixed else 1_000_000
    path = line + (Frame.op("aten::item"), Frame.op("aten::_local_scalar_dense"),
                   Frame.native(TORCH_LIB, "at::native::_local_scalar_dense_cuda"))
    t.add_many(path + (Frame.api("cuMemcpyDtoHAsync_v2"),), {"api_cpu_ns": n * 3_000, "copy_bytes": n * 4})
    t.add_many(path + (Frame.api("cuStreamSynchronize"),), {"api_cpu_ns": n * 1_000, "sync_wait_ns": n * (2_000 if fixed else 3_500)})
    return t


def gpu_alloc_churn(fixed: bool):
    s = "scenario_alloc_churn"
    t, main, step = base(s)
    line = main + (py(s, "step", 28),)
    alloc = line + (Frame.op("aten::mul"), Frame.op("aten::empty"),
                    Frame.native("libc10_cuda.so", "c10::cuda::CUDACachingAllocator::Native::DeviceCachingAllocator::malloc"))
    n = 0 if fixed else 20_000
    t.add_many(line + (Frame.op("aten::mul"), Frame.op("aten::empty")), {"alloc_bytes": 10_000 * 128 * 2**20})
    if n:
        t.add_many(alloc + (Frame.api("cuMemAlloc_v2"),), {"api_cpu_ns": n * 60_000})
        t.add_many(line + (Frame.api("cuMemFree_v2"),), {"api_cpu_ns": n * 30_000, "sync_wait_ns": n * 50_000})
    return t


def backward_linked(fixed: bool):
    """Backward kernels charged to the forward line (the join's sequence-number link)."""
    s = "scenario_embedding_backward"
    t, main, step = base(s)
    fwd = main + (py(s, "forward", 25),)
    launches(t, fwd, "aten::embedding", "indexSelectLargeIndex<float, long, unsigned int, 2, 2, -2, true>", 10_000, 20_000)
    bwd = fwd + (Frame.op("autograd::engine::evaluate_function: EmbeddingBackward0"), Frame.op("EmbeddingBackward0"))
    if fixed:
        launches(t, bwd, "aten::embedding_sparse_backward", "indexing_backward_kernel_sparse", 10_000, 30_000)
    else:
        launches(t, bwd, "aten::embedding_dense_backward", "vectorized_elementwise_kernel<4, FillFunctor<float>>", 10_000, 350_000)
        launches(t, bwd, "aten::embedding_dense_backward", "indexing_backward_kernel<float, 4>", 10_000, 90_000)
    return t


SCENARIOS = {
    "gpu_kernel_fusion": (kernel_fusion, "kernel_fusion", "py:tests/targets/scenario_kernel_fusion.py:gelu_layernorm:18"),
    "gpu_launch_bound": (launch_bound, "launch_bound", "py:tests/targets/scenario_launch_bound.py:per_item_matmuls:25"),
    "gpu_h2d_copies": (h2d_copies, "host_device_copies", "py:tests/targets/scenario_h2d_copies.py:step:27"),
    "gpu_fp32_gemm": (fp32_gemm, "fp32_gemm", "py:tests/targets/scenario_fp32_gemm.py:forward:16"),
    "gpu_item_sync": (gpu_item_sync, "sync_stalls", "py:tests/targets/scenario_item_sync.py:step:30"),
    "gpu_alloc_churn": (gpu_alloc_churn, "allocator_churn", "py:tests/targets/scenario_alloc_churn.py:step:28"),
    "gpu_backward_linked": (backward_linked, "backward_cost", "py:tests/targets/scenario_embedding_backward.py:forward:25"),
}


def build(name: str, fixed: bool, gpu: bool = True):
    fn = SCENARIOS[name][0]
    meta = dict(META, scenario=name, fixed=fixed, duration_s=WALL_NS / 1e9)
    unavailable = set() if gpu else {"gpu_time_ns", "kernel_count"}
    tree = fn(fixed)
    return tree.snapshot(meta=meta, unavailable=unavailable)


def write() -> None:
    for name in SCENARIOS:
        d = DATA / name
        d.mkdir(parents=True, exist_ok=True)
        for fixed in (False, True):
            obj = to_json(build(name, fixed))
            (d / ("fixed.json" if fixed else "problem.json")).write_text(json.dumps(obj, indent=1, sort_keys=True) + "\n")


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_committed_synthetic_snapshot_matches_builder(name):
    for fixed in (False, True):
        path = DATA / name / ("fixed.json" if fixed else "problem.json")
        assert from_json(json.loads(path.read_text())) == build(name, fixed), f"regenerate {path} (see module doc)"


if __name__ == "__main__":
    if sys.argv[1:] == ["--write"]:
        write()
    else:
        sys.exit("usage: python -m tests.unit.test_analyzer_synthetic --write")
