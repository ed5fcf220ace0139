"""Attach the real agent by PID to a running CPU JAX target (issue 10, acceptance 3 + 2).

Checks: Python samples with the jitted step's call-site frames, the HLO map of ``jit_step`` naming
the dense and attention source files, compile events of recompilations (new shapes) on the
triggering call site, the note that kernel attribution needs a GPU, and a clean detach.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest

pytest.importorskip("jax")

from stacklens.daemon.join.joiner import Joiner  # noqa: E402
from stacklens.inject.channel.server import AgentServer  # noqa: E402
from stacklens.inject.injector import inject_agent  # noqa: E402
from stacklens.records.agent import Note, PySample  # noqa: E402
from stacklens.records.agent import CompileRecord, HloMapRecord  # noqa: E402
from tests.integration.test_inject import Target, threads  # noqa: E402  (skips without ptrace)

pytestmark = pytest.mark.integration
TARGETS = Path(__file__).resolve().parents[1] / "targets"


def line_of(file: str, marker: str) -> int:
    return next(i for i, l in enumerate((TARGETS / file).read_text().splitlines(), 1) if marker in l)


def test_agent_on_cpu_jax_target(tmp_path):
    t = Target("jax_step.py", "--grow")
    srv = AgentServer(t.pid, tmp_path / "agents")
    recs = []
    try:
        base_threads = threads(t.pid)
        inject_agent(t.pid, srv.path, timeout_s=20)
        end = time.monotonic() + 30
        while time.monotonic() < end:
            time.sleep(0.25)
            recs.extend(srv.poll())
            have_grow = any(isinstance(r, CompileRecord) and r.frames and r.frames[-1][1] == "grow" for r in recs)
            # an executable compiled after the attach, with its call site (the ones compiled
            # before it are found at the start and come first, without one)
            have_hlo = any(isinstance(r, HloMapRecord) and r.module == "jit_step" and r.site
                           and r.site[-1][1] == "grow" for r in recs)
            if have_grow and have_hlo and sum(isinstance(r, PySample) for r in recs) > 50:
                break
        assert srv.stop_agent(10)
        recs.extend(srv.poll())
        end = time.monotonic() + 5
        while threads(t.pid) != base_threads and time.monotonic() < end:
            time.sleep(0.05)
        assert threads(t.pid) == base_threads
        assert srv.stats().get("rejected_message", 0) == 0, srv.stats()
    finally:
        srv.close()
        t.proc.send_signal(signal.SIGTERM)
    out, err = t.finish()
    assert t.proc.returncode == 0, err
    assert "steps=" in out

    step_file = str(TARGETS / "jax_step.py")
    # 1. Python samples of the main thread with the jitted step's call site
    main = [r for r in recs if isinstance(r, PySample) and r.tid == t.pid]
    calls = [s for s in main if any(f == (step_file, "run_step", line_of("jax_step.py", "STEP_CALL")) for f in s.frames)]
    assert len(calls) > 0.3 * len(main) > 10, (len(calls), len(main))
    # 2. the HLO map of the step: fused kernels -> the dense and attention source lines
    hlo = [r for r in recs if isinstance(r, HloMapRecord) and r.module == "jit_step"]
    assert hlo
    ops = {(Path(o[1]).name, o[2]) for r in hlo for k in r.kernels for o in k.ops}
    assert ("jax_dense.py", line_of("jax_dense.py", "DENSE_MATMUL")) in ops, ops
    assert ("jax_attention.py", line_of("jax_attention.py", "ATTN_VALUES")) in ops, ops
    # executables compiled after the attach carry their call site (grow's recompilations)
    assert any(r.site and r.site[-1][1] == "grow" for r in hlo)
    # 3. recompilation (new shapes) -> compile events on the grow() call site
    grow = [r for r in recs if isinstance(r, CompileRecord) and r.fun_name in ("step", "jit(step)")]
    assert grow and all(r.frames[-1][:2] == (step_file, "grow") and r.frames[-1][2] == line_of("jax_step.py", "GROW_CALL")
                        for r in grow), [r.frames[-1] for r in grow]
    assert any(r.event.endswith("backend_compile_duration") for r in grow)
    # 4. the note: CPU-only JAX, kernel attribution needs a GPU
    assert any(isinstance(r, Note) and "needs a GPU" in r.message for r in recs)

    # daemon side: compile_time_ns on the grow() call site path
    j = Joiner(t.pid, agent=True)
    for r in recs:
        j.on_agent(r)
    snap = j.snapshot()
    site = [p for p, m in snap.iter_paths() if m.get("compile_time_ns") and p[-1].name == "grow"]
    assert site
