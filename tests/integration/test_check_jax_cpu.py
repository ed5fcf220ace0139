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
    side = res["profiler_side"]
    assert side["basis"] == "hlo_op" and sum(side["events_per_module_kind"].values()) == res["profiler_mapping"]["hlo_op"]
    # one small file comes back (the device returns few files): no trace, no agent folder, no stderr log
    assert [p.name for p in tmp_path.iterdir()] == ["check_jax.json"]
    assert (tmp_path / "check_jax.json").stat().st_size < 32_000


# ---- the profiler side for real: jax.profiler's CPU thunk events carry hlo_module/hlo_op stats -------

_TRACE = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
import jax
import check_jax
step, params, x = check_jax.build_step(2, 32, 64, 4)
compiled = step.lower(params, x).compile()      # the executable traced below: its HLO is the map
params, l = compiled(params, x)
l.block_until_ready()
with jax.profiler.trace(sys.argv[2]):
    for _ in range(int(sys.argv[3])):
        params, l = compiled(params, x)
    l.block_until_ready()
open(sys.argv[4], "w").write(compiled.as_text())
"""


def _cpu_trace(tmp_path, steps):
    import os
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    r = subprocess.run([sys.executable, "-c", _TRACE, str(REPO / "benchmarks/gpu"), str(tmp_path / "trace"), str(steps),
                        str(tmp_path / "hlo.txt")], capture_output=True, text=True, timeout=180, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    return (tmp_path / "hlo.txt").read_text()


def test_profiler_side_spreads_cpu_thunk_time_over_dense_and_attention_lines(tmp_path):
    from tests.unit.test_jax import _check_jax
    from stacklens.daemon.join.jaxjoin import sanitize
    from stacklens.inject.agent.jaxmeta import parse_hlo_text
    from stacklens.records.agent import HloKernel, HloMapRecord

    cj = _check_jax()
    steps = 4
    module, entries = parse_hlo_text(_cpu_trace(tmp_path, steps))
    events, _shape = cj.profiler_events(str(tmp_path / "trace"), cpu=True)
    assert events and {ev.module for ev in events} == {module}
    rec = HloMapRecord("m1", module, "cpu", 0, 1, (),
                       tuple(HloKernel(n, op, tuple(tuple(o) for o in ops)) for n, op, ops in entries))

    def mapped(evs):
        diag: dict = {}
        prof, ways, unknown = cj.map_profiler(evs, cj._index([rec]), sanitize, steps, diag)
        return prof, ways, unknown, diag

    prof, ways, unknown, diag = mapped(events)
    assert ways == {"hlo_op": len(events)} and not unknown and diag["basis"] == "hlo_op"
    ag = diag["hlo_op_agrees_with_kernel_name"]
    assert ag["checked"] == ag["agree"] == len(events)

    # the same numbers straight from the parsed HLO (instruction -> its operators, even split)
    ops_by_instr = {n: ops for n, _op, ops in entries}
    expect: dict = {}
    for ev in events:
        ops = ops_by_instr[ev.hlo_op]
        if not ops:                                   # e.g. a copy with no metadata
            expect["[no operator]"] = expect.get("[no operator]", 0.0) + ev.dur_ns / steps
        for o in ops:
            key = f"{Path(o[1]).name}:{o[2]} ({o[3]})" if o[1] else f"[{o[0]}]"
            expect[key] = expect.get(key, 0.0) + ev.dur_ns / steps / len(ops)
    assert set(prof) == set(expect) and all(prof[k] == pytest.approx(v) for k, v in expect.items())
    total = sum(ev.dur_ns for ev in events) / steps
    assert sum(prof.values()) == pytest.approx(total)

    src = (REPO / "benchmarks/gpu/check_jax.py").read_text().splitlines()
    dense = next(i for i, l in enumerate(src, 1) if "# DENSE" in l)
    attn = [i for i, l in enumerate(src, 1) if "# ATTN_" in l]
    share = {k: v / total for k, v in prof.items()}
    dense_share = share.get(f"check_jax.py:{dense} (dense)", 0.0)
    attn_shares = [share.get(f"check_jax.py:{i} (attention)", 0.0) for i in attn]
    # time is spread: the dense line and most attention lines each hold a real part, none holds all
    assert 0.02 < dense_share < 0.6, share
    assert sum(1 for s in attn_shares if s > 0.02) >= 4 and sum(attn_shares) > 0.3, share
    assert max(share.values()) < 0.6, share

    # GPU run 7's symptom: every event carrying one instruction's hlo_op. The kernel names disagree
    # with it, so the profiler side falls back to them (same per-line result); by hlo_op alone all
    # the time would sit on that one instruction's operators.
    first = min((e for e in events if ops_by_instr[e.hlo_op]), key=lambda e: e.start_ns)
    stuck = [ev._replace(hlo_op=first.hlo_op) for ev in events]
    prof2, ways2, _u, diag2 = mapped(stuck)
    assert diag2["basis"] == "kernel_name" and ways2.get("kernel_name:name") == len(events)
    ag2 = diag2["hlo_op_agrees_with_kernel_name"]
    assert ag2["agree"] == sum(1 for ev in events if ev.hlo_op == first.hlo_op) < 0.9 * ag2["checked"]
    assert set(prof2) == set(prof) and all(prof2[k] == pytest.approx(v) for k, v in prof.items())
    stuck_lines = {f"{Path(o[1]).name}:{o[2]} ({o[3]})" if o[1] else f"[{o[0]}]" for o in ops_by_instr[first.hlo_op]}
    assert set(diag2["by_hlo_op_ms_per_step"]) == stuck_lines
    assert sum(diag2["by_hlo_op_ms_per_step"].values()) == pytest.approx(total / 1e6)
