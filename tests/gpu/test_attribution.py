"""Acceptance 1 of issue 9 on the GPU machine: attribution against ground truth.

Two functions launching disjoint kernel sets (GEMMs vs convolutions), attached by PID after warm-up
with ProcessSession(agent=True). Asserts, for exactly K steps (STACKLENS_GT_STEPS, default 100):
- GPU time per function (under its Python frame) within 2% of torch.profiler's sum of the same
  kernels (K calls profiled after detach), and the f/g ratio within 2%;
- launch and kernel counts exact, per kernel name; nothing attributed elsewhere;
- the operator under every kernel right (aten::mm under f, aten::convolution… under g).
Run twice: f and g one after the other on one thread, and at once on two threads (their launches
interleave, so the joins must tell the threads' kernels apart; STACKLENS_GT_MODES=serial to skip).
Skipped without CUDA or root. Raw numbers: $STACKLENS_GPU_OUT/attribution.json when set.
Without pytest: python benchmarks/gpu/check_attribution.py (same checks).
"""

from __future__ import annotations

import os

import pytest

from tests.gpu.attribution import FUNCS, checks, context, run_experiment

STEPS = int(os.environ.get("STACKLENS_GT_STEPS", "100"))


def skip_reason() -> str | None:
    if os.geteuid() != 0:
        return "needs root (BPF, ptrace)"
    try:
        import torch
    except Exception as e:  # noqa: BLE001
        return f"torch not importable: {e}"
    if not torch.cuda.is_available():
        return "no CUDA device"
    return None


pytestmark = pytest.mark.gpu


MODES = [m for m in os.environ.get("STACKLENS_GT_MODES", "serial,threads").split(",") if m]


@pytest.fixture(scope="module", params=MODES)
def verdicts(request):
    reason = skip_reason()
    if reason:
        pytest.skip(reason)
    rec = run_experiment(steps=STEPS, out_dir=os.environ.get("STACKLENS_GPU_OUT"),
                         threads=request.param == "threads")
    return rec, checks(rec)


def _check(verdicts, name):
    rec, v = verdicts
    ok, msg = v[name]
    assert ok, msg + context(rec)


def test_truth_is_sound(verdicts):
    _check(verdicts, "truth_is_sound")


@pytest.mark.parametrize("key", list(FUNCS))
def test_gpu_time_per_function_within_2pct(verdicts, key):
    _check(verdicts, f"gpu_time_{key}")


def test_gpu_time_ratio_within_2pct(verdicts):
    _check(verdicts, "ratio")


@pytest.mark.parametrize("key", list(FUNCS))
def test_launch_and_kernel_counts_exact(verdicts, key):
    _check(verdicts, f"counts_{key}")


def test_nothing_lands_elsewhere(verdicts):
    _check(verdicts, "nothing_elsewhere")


@pytest.mark.parametrize("key", list(FUNCS))
def test_operator_under_each_kernel(verdicts, key):
    _check(verdicts, f"operators_{key}")
