"""The agent is a guest (issue 35, acceptance 4): 30 attach/detach cycles each on a CPU
torch.compile'd training step and a CPU jitted JAX step, side by side; the targets raise nothing,
print nothing new, and every episode's outputs equal the first one's, computed before any attach.

The workloads are tests/targets/safety_workloads.py (the GPU safety matrix runs the same ones:
benchmarks/gpu/safety_matrix.py). A cycle injects the real agent, waits until it has sent what
its Inductor reader or JAX watcher reads (the parts that touch the target's objects), and detaches.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from stacklens.inject.channel.server import AgentServer
from stacklens.inject.injector import inject_agent
from stacklens.records.agent import HloMapRecord, InductorRecord
from tests.integration.test_inject import threads, wait_for  # noqa: F401  (skips without ptrace)

pytestmark = pytest.mark.integration
TARGET = Path(__file__).resolve().parents[1] / "targets" / "safety_workloads.py"
CYCLES = 30
TOLERANCE = 1e-6          # the same process, the same CPU kernels: equal but for summation order


class Workload:
    def __init__(self, name: str, log: Path):
        self.name, self.log = name, log
        self.proc = subprocess.Popen([sys.executable, str(TARGET), name, "--device", "cpu", "--log", str(log),
                                      "--steps", "2", "--pause-s", "0.01"],
                                     stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True)
        self.pid = self.proc.pid
        self.lines: list[str] = []
        self.ready = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line.strip())
            if line.strip() == "ready":
                self.ready.set()

    def episodes(self) -> list[dict]:
        return [json.loads(x) for x in self.log.read_text().splitlines() if x.strip()]

    def end(self) -> tuple[int, str]:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            _, err = self.proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            _, err = self.proc.communicate()
        return self.proc.returncode, err


def cycles(w: Workload, tmp: Path, wanted, out: dict) -> None:
    """CYCLES agent attach/detach cycles; each waits until the agent sent `wanted` records (the
    reader that walks the target's objects has run) or, after the first such cycle, its stats."""
    done = ok_reads = 0
    errors = []
    base = threads(w.pid)
    for i in range(CYCLES):
        srv = AgentServer(w.pid, tmp / f"agents-{w.name}")
        recs: list = []
        try:
            inject_agent(w.pid, srv.path, timeout_s=60)

            def got():
                recs.extend(srv.poll())
                return any(isinstance(r, wanted) for r in recs) or (
                    ok_reads and any(type(r).__name__ == "AgentStats" for r in recs))
            wait_for(got, timeout=120, what=f"{w.name} cycle {i}: the agent's first records")
            ok_reads += any(isinstance(r, wanted) for r in recs)
            assert srv.stop_agent(20), f"{w.name} cycle {i}: the agent did not detach"
            wait_for(lambda: threads(w.pid) == base, timeout=20, what=f"{w.name} cycle {i}: the agent thread gone")
            done += 1
        except BaseException as e:  # noqa: BLE001 - reported with the cycle's number
            errors.append(f"cycle {i}: {type(e).__name__}: {e}")
            break
        finally:
            srv.close()
    out[w.name] = {"cycles": done, "reads": ok_reads, "errors": errors}


def test_agent_cycles_leave_compiled_and_jitted_targets_unchanged(tmp_path):
    pytest.importorskip("torch")
    pytest.importorskip("jax")
    ws = [Workload("compile_default", tmp_path / "compile.jsonl"), Workload("jax", tmp_path / "jax.jsonl")]
    results: dict = {}
    try:
        for w in ws:
            assert w.ready.wait(600), f"{w.name} did not get ready: {w.proc.poll()} {w.lines}"
        ths = [threading.Thread(target=cycles, args=(w, tmp_path, wanted, results))
               for w, wanted in zip(ws, (InductorRecord, HloMapRecord))]
        for th in ths:
            th.start()
        for th in ths:
            th.join()
        n_before_end = {w.name: len(w.episodes()) for w in ws}
        # the targets go on after the last detach: two more episodes each
        for w in ws:
            wait_for(lambda w=w: len(w.episodes()) >= n_before_end[w.name] + 2, timeout=120,
                     what=f"{w.name}: episodes after the last detach")
    finally:
        ends = {w.name: w.end() for w in ws}
    for w in ws:
        rc, err = ends[w.name]
        r = results.get(w.name, {})
        assert r.get("errors") == [] and r.get("cycles") == CYCLES, (w.name, r)
        assert r["reads"] >= 1, (w.name, r)         # the reader ran in at least one cycle
        assert rc == 0, (w.name, rc, err[-2000:])
        assert "Traceback" not in err and "Error" not in err, (w.name, err[-2000:])
        eps = w.episodes()
        first = eps[0]["out"]
        assert len(eps) > CYCLES // 10
        for e in eps:
            assert len(e["out"]) == len(first)
            for x, y in zip(e["out"], first):
                assert abs(x - y) <= TOLERANCE * max(1.0, abs(y)), (w.name, e["ep"], x, y)
