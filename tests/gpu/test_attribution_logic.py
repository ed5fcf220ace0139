"""The attribution analysis itself (tests/gpu/attribution.py) on synthetic trees: runs anywhere."""

from __future__ import annotations

from stacklens.cct import CCT, Frame
from tests.gpu.attribution import analyze, checks

FILE = "/x/tests/targets/gpu_ground_truth.py"
MAIN = (Frame.python(FILE, "main", 90), Frame.python(FILE, "step", 70))
F = MAIN + (Frame.python(FILE, "gt_matmul_f", 60), Frame.op("aten::mm"))
G = MAIN + (Frame.python(FILE, "gt_conv_g", 66), Frame.op("aten::conv2d"), Frame.op("aten::convolution"),
            Frame.op("aten::cudnn_convolution"))
API = Frame.api("cuLaunchKernelEx")
K = 50


def prof(kernels):
    return {"kernels": {n: {"count": c, "dur_ns": d} for n, (c, d) in kernels.items()},
            "total_ns": sum(d for _, d in kernels.values()), "count": sum(c for c, _ in kernels.values())}


PROF = {"f": [prof({"nvjet_tst_128x256": (4 * K, 4 * K * 1_000_000)})] * 2,
        "g": [prof({"sm90_xmma_fprop_implicit_gemm": (2 * K, 2 * K * 500_000),
                    "void cudnn::nchwToNhwcKernel<float>(int)": (2 * K, 2 * K * 20_000)})] * 2}


def tree(f_ns=1_000_000, g_launch_extra=0, op_f="aten::mm", stray=False):
    t = CCT()
    kf = F[:-1] + (Frame.op(op_f), API, Frame.kernel("nvjet_tst_128x256"))
    t.add_many(kf, {"launch_count": 4 * K, "kernel_count": 4 * K, "gpu_time_ns": 4 * K * f_ns})
    t.add_many(G + (API, Frame.kernel("sm90_xmma_fprop_implicit_gemm")),
               {"launch_count": 2 * K + g_launch_extra, "kernel_count": 2 * K, "gpu_time_ns": 2 * K * 500_000})
    # CUPTI gives this one mangled; torch.profiler demangled
    t.add_many(G + (Frame.api("cuLaunchKernel"), Frame.kernel("_ZN5cudnn15nchwToNhwcKernelIfEEvi")),
               {"launch_count": 2 * K, "kernel_count": 2 * K, "gpu_time_ns": 2 * K * 20_000})
    if stray:
        t.add_many(MAIN + (Frame.op("aten::add_"), API, Frame.kernel("elementwise")), {"launch_count": 1})
    return t.snapshot()


def test_exact_tree_passes_every_check():
    v = checks({"analysis": analyze(tree(), PROF, K)})
    assert all(ok for ok, _ in v.values()), {k: m for k, (ok, m) in v.items() if not ok}


def test_gpu_time_off_by_3pct_fails_f_and_ratio():
    v = checks({"analysis": analyze(tree(f_ns=1_030_000), PROF, K)})
    assert not v["gpu_time_f"][0] and not v["ratio"][0] and v["gpu_time_g"][0]


def test_an_extra_launch_fails_the_counts():
    v = checks({"analysis": analyze(tree(g_launch_extra=1), PROF, K)})
    assert not v["counts_g"][0] and v["counts_f"][0]


def test_wrong_operator_fails():
    v = checks({"analysis": analyze(tree(op_f="aten::add_"), PROF, K)})
    assert not v["operators_f"][0] and v["operators_g"][0]


def test_launch_outside_the_functions_fails():
    v = checks({"analysis": analyze(tree(stray=True), PROF, K)})
    assert not v["nothing_elsewhere"][0]
