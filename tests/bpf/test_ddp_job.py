"""A distributed job through stacklensd, as root with real probes (issue 31, points 1 and 4).

- A 2-rank DDP training job on CPU (gloo) under torchrun, rank 1 slow on purpose
  (tests/targets/ddp_train.py, SLOW_RANK=1): `stacklens attach --job LAUNCHER` attaches both
  ranks; each has its own tree, `ps --json` says its rank, Prometheus series carry rank labels
  (promtool-clean where promtool is installed); rank 0's wait for DDP's all-reduce sits on the
  `loss.backward()` line; `advise --job` names rank 1 and its slow line.
- Bad input on launcher-like parents without torch (tests/targets/fake_launcher.py): a PID with
  no ranks below and ranks of two jobs are refused with what to give; a rank that exits while
  its attach leaves the other attached, and says so.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from stacklens.daemon.client import DaemonClient
from tests.daemon_proc import Daemon, until
from tests.torchrun_job import TorchrunJob

REPO = Path(__file__).resolve().parents[2]
DDP = REPO / "tests" / "targets" / "ddp_train.py"
LAUNCHER = REPO / "tests" / "targets" / "fake_launcher.py"
BIN = Path(sys.executable).parent


def marker_line(path: Path, marker: str) -> int:
    return next(i for i, s in enumerate(path.read_text().splitlines(), 1) if s.rstrip().endswith(marker))


@pytest.fixture
def ddp_job():
    pytest.importorskip("torch.distributed")
    import torch.distributed as dist
    if not dist.is_gloo_available():
        pytest.skip("torch without gloo")
    job = TorchrunJob(DDP, dict(os.environ, SLOW_RANK="1"))
    yield job
    job.kill()


@pytest.mark.timeout(600)   # one BCC compile (tens of seconds on a loaded 2-core VM), two attaches
def test_ddp_job_ranks_trees_labels_collective_line_and_straggler(tmp_path, bpf_available, ddp_job):
    d = Daemon(tmp_path)
    try:
        r = d.cli("attach", "--job", str(ddp_job.launcher))
        assert r.returncode == 0, r.stdout + r.stderr
        assert "attached 2 of 2 ranks" in r.stdout
        pids = ddp_job.ranks

        ps = json.loads(d.cli("ps", "--json").stdout)["processes"]
        by_pid = {p["pid"]: p for p in ps}
        for rank, pid in pids.items():
            assert by_pid[pid]["state"] == "attached" and by_pid[pid]["rank"] == rank
            assert by_pid[pid]["world_size"] == 2 and by_pid[pid]["job"].startswith("127.0.0.1:")

        backward, slow = marker_line(DDP, "# BACKWARD"), marker_line(DDP, "# SLOW")
        with DaemonClient(str(d.sock)) as c:
            def waited_on_backward():
                snap = c.snapshot(pids[0])
                col = snap.exclusive_column("collective_wait_ns")
                hits = [n for n, v in enumerate(col) if v and any(
                    f.kind == "python" and f.file == str(DDP) and f.line == backward for f in snap.path(n))]
                return snap if hits else None
            snap0 = until("rank 0's wait for DDP's all-reduce on the backward line", waited_on_backward)
            # each rank its own tree: the slow line only in rank 1's
            def slow_line_in(snap) -> bool:
                return any(f.kind == "python" and f.file == str(DDP) and f.line == slow
                           for n in range(snap.node_count) for f in snap.path(n)[-1:])
            assert not slow_line_in(snap0) and snap0.meta["rank"]["rank"] == 0
            until("rank 1's slow line in its tree", lambda: slow_line_in(c.snapshot(pids[1])))

        metrics = urllib.request.urlopen(f"http://127.0.0.1:{d.port}/metrics", timeout=30).read().decode()
        for rank, pid in pids.items():
            assert (f'stacklens_collective_wait_seconds_total{{comm="python",container="",local_rank="{rank}",'
                    f'pid="{pid}",rank="{rank}",world_size="2"}}') in metrics
        if shutil.which("promtool"):
            p = subprocess.run(["promtool", "check", "metrics"], input=metrics, capture_output=True, text=True)
            assert p.returncode == 0, p.stdout + p.stderr

        def straggler():
            r = d.cli("advise", "--job", "--json", "--window", "10", str(ddp_job.launcher))
            assert r.returncode == 0, r.stderr
            return json.loads(r.stdout)["findings"]
        [f] = until("the straggler finding", straggler)
        assert f["rule"] == "straggler" and f["evidence"]["straggler_rank"] == 1
        assert f["path"][-1] == f"py:{DDP}:slow_down:{slow}"
        assert f["evidence"]["rank0_collective_wait_share"] > f["evidence"]["rank1_collective_wait_share"]
    finally:
        d.stop()


class FakeLauncher:
    def __init__(self, jobs: int, nproc: int) -> None:
        self.proc = subprocess.Popen([sys.executable, str(LAUNCHER), str(jobs), str(nproc)], stdout=subprocess.PIPE,
                                     text=True, start_new_session=True)
        self.pid = int(self.proc.stdout.readline().split()[1])
        self.ranks: dict[tuple[int, int], int] = {}
        while len(self.ranks) < jobs * nproc:
            _, job, rank, pid = self.proc.stdout.readline().split()
            self.ranks[(int(job), int(rank))] = int(pid)

    def kill(self) -> None:
        for pid in [*self.ranks.values(), self.proc.pid]:
            try:
                os.kill(pid, 9)
            except ProcessLookupError:
                pass
        self.proc.wait()
        self.proc.stdout.close()


@pytest.mark.timeout(600)
def test_job_attach_bad_input_and_a_rank_that_exits_during_the_attach(tmp_path, bpf_available):
    gate = tmp_path / "go"
    d = Daemon(tmp_path, env=dict(os.environ, STACKLENSD_TEST_ATTACH_GATE=str(gate)))
    two = FakeLauncher(2, 2)
    one = FakeLauncher(1, 2)
    try:
        r = d.cli("attach", "--job", str(two.pid))
        assert r.returncode == 2 and "belong to 2 jobs" in r.stderr, r.stdout + r.stderr
        r = d.cli("attach", "--job", str(one.ranks[(0, 0)]))   # a rank, not a launcher
        assert r.returncode == 2 and f"no process under PID {one.ranks[(0, 0)]} sets RANK" in r.stderr, r.stderr

        attach = subprocess.Popen([str(BIN / "stacklens"), "--socket", str(d.sock), "attach", "--job", str(one.pid)],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        with DaemonClient(str(d.sock)) as c:   # both ranks' attaches begin at once
            until("both ranks' attaches held at the gate",
                  lambda: {p.pid for p in c.processes() if "held by" in p.state} == set(one.ranks.values()))
        os.kill(one.ranks[(0, 1)], 9)          # rank 1 exits during its attach
        gate.touch()
        out, err = attach.communicate(timeout=300)
        assert attach.returncode != 0, out + err
        assert "rank 0" in out and f"(PID {one.ranks[(0, 0)]}): attached" in out, out + err
        assert f"rank 1 (PID {one.ranks[(0, 1)]}): not attached" in out, out + err
        assert "attached 1 of 2 ranks" in out
        ps = {p["pid"]: p for p in json.loads(d.cli("ps", "--json").stdout)["processes"]}
        assert ps[one.ranks[(0, 0)]]["state"] == "attached" and ps[one.ranks[(0, 0)]]["rank"] == 0
        assert d.proc.poll() is None
    finally:
        one.kill()
        two.kill()
        d.stop()
