"""CUPTI collector, attached by PID to a running torch CUDA job (issue 4, acceptance point 3).

Run as root on the GPU machine with cupti-python importable by the target (PYTHONPATH).
Skips without a CUDA GPU.
"""

import pytest

pytestmark = pytest.mark.gpu


def _gpu_reason():
    try:
        import torch
    except ImportError:
        return "torch not installed"
    if not torch.cuda.is_available():
        return "no CUDA GPU"
    try:
        import cupti  # noqa: F401
    except ImportError:
        return "cupti-python not installed (see ../shared/device/README.md)"
    return None


_WHY = _gpu_reason()
if _WHY:
    pytest.skip(_WHY, allow_module_level=True)


@pytest.fixture(scope="module")
def report():
    import importlib.util
    from pathlib import Path
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu" / "bench_cupti.py"
    spec = importlib.util.spec_from_file_location("bench_cupti", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.run()


def test_every_kernel_of_the_sequence_counted_exactly(report):
    seq = {n: k for n, k in report["kernels"].items() if k["profiler_count"] >= 50}
    assert seq, report
    for name, k in seq.items():
        assert k["our_count"] == k["profiler_count"], (name, k)


def test_durations_agree_with_torch_profiler_within_5_percent(report):
    for name, k in report["kernels"].items():
        if k["profiler_count"] >= 50:
            assert abs(k["our_mean_ns"] - k["profiler_mean_ns"]) <= 0.05 * k["profiler_mean_ns"], (name, k)


def test_job_runs_at_unprofiled_speed_after_detach(report):
    assert report["us_per_step_after"] <= 1.05 * report["us_per_step_before"], report
