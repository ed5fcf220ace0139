"""Acceptance 3 of issue 23 on the GPU machine (copies and memsets): per Python function and copy
kind, stacklens's memcpy/memset counts equal torch.profiler's and their GPU time is within 5%
(tests/gpu/copies.py). Run for the order join and for the API-record join
(STACKLENS_COPY_MODES=order to skip the second). Skipped without CUDA or root. Raw numbers:
$STACKLENS_GPU_OUT/copies.json when set. Without pytest: python benchmarks/gpu/check_copies.py.
"""

from __future__ import annotations

import os

import pytest

from tests.gpu.copies import checks, context, run_experiment
from tests.gpu.test_attribution import skip_reason

STEPS = int(os.environ.get("STACKLENS_COPY_STEPS", "200"))
MODES = [m for m in os.environ.get("STACKLENS_COPY_MODES", "order,api").split(",") if m]

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module", params=MODES)
def verdicts(request):
    reason = skip_reason()
    if reason:
        pytest.skip(reason)
    rec = run_experiment(steps=STEPS, out_dir=os.environ.get("STACKLENS_GPU_OUT"),
                         api_records=request.param == "api")
    return rec, checks(rec)


def test_copies_and_memsets_match_torch_profiler(verdicts):
    rec, v = verdicts
    bad = [msg for ok, msg in v.values() if not ok]
    assert not bad, "\n".join(bad) + context(rec)
