"""A torch.distributed job from its ranks' environments (introspect/ranks.py: find_job, rank_of)
and the straggler rule over the ranks' snapshots (analyzer/job.py), on fakes and built trees.

The same on a real 2-rank gloo DDP job through stacklensd: tests/integration/test_ddp_job.py.
"""

from __future__ import annotations

import pytest

from stacklens.analyzer.job import job_notes, stragglers
from stacklens.cct import CCT, Frame, metrics
from stacklens.introspect.ranks import find_job, find_ranks, rank_of
from stacklens.errors import InputError

TRAIN = "/job/train.py"


class FakeHost:
    def __init__(self, tree: dict[int, list[int]], envs: dict[int, dict[str, str]]) -> None:
        self.tree, self.envs = tree, envs

    def children(self, pid):
        return self.tree.get(pid, [])

    def environ(self, pid):
        return self.envs.get(pid)


def _env(rank: int, port: int = 29500, world: int = 2) -> dict[str, str]:
    return {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(world),
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "TORCHELASTIC_RUN_ID": "none"}


def test_rank_of_reads_what_torchrun_sets():
    r = rank_of(10, _env(1))
    assert (r.rank, r.local_rank, r.world_size, r.job) == (1, 1, 2, "127.0.0.1:29500 run none")
    assert r.labels() == {"rank": "1", "local_rank": "1", "world_size": "2"}
    assert rank_of(10, {"PATH": "/bin"}) is None and rank_of(10, None) is None
    assert rank_of(10, {"RANK": "x"}) is None


def test_a_jobs_name_from_the_environment_is_escaped_and_bounded():
    r = rank_of(10, {**_env(0), "MASTER_ADDR": "\x1b[31mevil" + "x" * 1000})
    assert "\x1b" not in r.job and "\\x1b" in r.job and len(r.job) <= 256 * 4


def test_find_job_takes_the_launchers_ranks():
    host = FakeHost({1: [10, 20], 10: [11]}, {10: _env(0), 11: _env(0), 20: _env(1)})
    assert [(r.rank, r.pid) for r in find_job(host, 1)] == [(0, 10), (1, 20)]


def test_a_pid_without_ranks_below_is_refused_with_what_to_give():
    host = FakeHost({1: [10]}, {10: {"PATH": "/bin"}})
    with pytest.raises(InputError, match="no process under PID 1 sets RANK"):
        find_job(host, 1)


def test_ranks_of_two_jobs_under_one_pid_are_refused_naming_both():
    # a shell that started two torchrun jobs: the same ranks twice, told apart by their rendezvous
    host = FakeHost({1: [2, 3], 2: [10, 20], 3: [30, 40]},
                    {10: _env(0), 20: _env(1), 30: _env(0, 29600), 40: _env(1, 29600)})
    assert len(find_ranks(host, 1)) == 4
    with pytest.raises(InputError, match="belong to 2 jobs") as e:
        find_job(host, 1)
    assert "127.0.0.1:29500" in str(e.value) and "127.0.0.1:29600" in str(e.value)
    assert [r.pid for r in find_job(host, 3)] == [30, 40]


BACKWARD = Frame.python(TRAIN, "main", 46)
WAIT = Frame.api("c10d:DDP all-reduce wait (Reducer::finalize_backward)")


def rank_snapshot(wait_s: float, step_samples: int, slow_samples: int, *, window_s: float = 10.0,
                  measured: bool = True):
    """One rank's window: `step_samples` CPU samples on the forward line, `slow_samples` on a
    line only a slow rank runs, `wait_s` waiting in DDP's all-reduce on the backward line."""
    t = CCT(metrics=metrics.ALL, max_nodes=None)
    root = (Frame.python(TRAIN, "<module>", 60),)
    t.add(root + (Frame.python(TRAIN, "main", 43), Frame.op("aten::addmm")), "cpu_samples", step_samples)
    if slow_samples:
        t.add(root + (Frame.python(TRAIN, "main", 45), Frame.python(TRAIN, "slow_down", 27),
                      Frame.op("aten::mm")), "cpu_samples", slow_samples)
    if wait_s:
        t.add(root + (BACKWARD, WAIT), "collective_wait_ns", int(wait_s * 1e9))
    unavailable = () if measured else ("collective_wait_ns",)
    return t.snapshot(meta={"cpu_hz": 100, "window_s": window_s}, unavailable=unavailable)


def test_the_rank_the_others_wait_for_is_named_with_its_slow_line():
    snaps = {0: rank_snapshot(4.0, 500, 0), 1: rank_snapshot(0.3, 500, 380), 2: rank_snapshot(3.6, 480, 0)}
    [f] = stragglers(snaps)
    assert f.rule == "straggler" and f.severity == "high"
    assert "rank 1 is the straggler" in f.title and f"{TRAIN}:27 (slow_down)" in f.title
    assert f.path[-1] == f"py:{TRAIN}:slow_down:27"
    assert f.evidence["straggler_rank"] == 1
    assert f.evidence["rank0_collective_wait_share"] == pytest.approx(0.4)
    assert f.evidence["line_extra_cpu_share"] == pytest.approx(0.38)
    assert 0.3 <= f.estimated_saving <= 0.38


def test_ranks_that_wait_alike_have_no_straggler():
    snaps = {0: rank_snapshot(1.0, 500, 0), 1: rank_snapshot(0.8, 500, 20)}
    assert stragglers(snaps) == []


def test_a_rank_without_collective_waits_measured_leaves_the_job_without_a_finding():
    snaps = {0: rank_snapshot(4.0, 500, 0), 1: rank_snapshot(0.0, 500, 380, measured=False)}
    assert stragglers(snaps) == []
    assert any("ranks 1 measured no collective waits" in n for n in job_notes(snaps))
    assert job_notes({0: snaps[0]}) == ["stragglers: fewer than 2 ranks attached"]
