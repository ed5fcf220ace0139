"""benchmarks/gpu/check_jax.py keeps working: its --cpu smoke mode here (attach by PID, HLO maps,
name matching and split vs jax.profiler's hlo_op stats, the step estimate, the recompile on the
`grow` call site, no agent message rejected, the GPU-needed note)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("jax")
from tests.integration.test_inject import Target  # noqa: E402,F401  (skips without ptrace)

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]


def test_check_jax_cpu_smoke(tmp_path):
    r = subprocess.run([sys.executable, str(REPO / "benchmarks/gpu/check_jax.py"), "--cpu", "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    res = json.loads((tmp_path / "check_jax.json").read_text())
    assert res["pass"] and res["mode"] == "cpu"
    lines = {row["line"].split(" ")[0] for row in res["lines"] if row["judged"]}
    src = (REPO / "benchmarks/gpu/check_jax.py").read_text().splitlines()
    dense = next(i for i, l in enumerate(src, 1) if "# DENSE" in l)
    scores = next(i for i, l in enumerate(src, 1) if "# ATTN_SCORES" in l)
    assert f"check_jax.py:{dense}" in lines and f"check_jax.py:{scores}" in lines, lines
    checks = res["checks"]
    assert checks["recompile: compile time on the triggering call site"] and checks["no agent message rejected"]
    grow = next(i for i, l in enumerate(src, 1) if l.rstrip().endswith("# GROW"))
    assert res["recompile"]["grow_line"] == grow and res["recompile"]["compile_ms_at_grow_site"] > 0
    assert "/jax/core/compile/backend_compile_duration" in res["recompile"]["events_at_grow_site"]
    assert res["stacklens_steps"] == res["args"]["profile_steps"] and res["step_estimates"]["names"] > 0
    assert res["profiler_mapping"].get("hlo_op", 0) > 0 and not res["profiler_mapping"].get("unknown")
