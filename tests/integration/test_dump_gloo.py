"""`stacklens dump` on a real 2-rank gloo job on CPU (tests/targets/gloo_hang.py under torchrun):
rank 0 blocked in all_reduce, rank 1 never joins.

Root (reads /proc/PID/mem of the ranks; skipped with the reason where that is not allowed).
Checks: the dump of rank 0 returns within 1 s and shows the all_reduce line in its main thread;
the target's busy thread runs as fast after the dump as before (iterations per CPU second,
from its own `progress` lines) and is not left traced or stopped; `dump --job` names rank 1.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.torchrun_job import TorchrunJob

ROOT = Path(__file__).resolve().parents[2]
TARGET = ROOT / "tests" / "targets" / "gloo_hang.py"
STACKLENS = [str(Path(sys.executable).with_name("stacklens"))]   # the installed command
COLLECTIVE_LINE = next(i for i, s in enumerate(TARGET.read_text().splitlines(), 1) if "# COLLECTIVE" in s)


class GlooJob(TorchrunJob):
    """tests/targets/gloo_hang.py under torchrun, with rank 0's progress lines."""

    def __init__(self, env: dict[str, str]) -> None:
        super().__init__(TARGET, env)

    def progress(self, n: int) -> list[tuple[int, float, float]]:
        """The next `n` progress lines of rank 0's busy thread: (iterations, cpu s, wall s)."""
        out = []
        while len(out) < n:
            line = self.next_line(30, what="a progress line")
            if line.startswith("progress "):
                _, it, cpu, wall = line.split()
                out.append((int(it), float(cpu), float(wall)))
        return out


@pytest.fixture(scope="module")
def env(tmp_path_factory) -> dict[str, str]:
    # bytecode cached (as an installed stacklens has it), outside the repository
    e = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    e["PYTHONPYCACHEPREFIX"] = str(tmp_path_factory.mktemp("pycache"))
    return e


@pytest.fixture(scope="module")
def job(env):
    pytest.importorskip("torch.distributed")
    import torch.distributed as dist
    if not dist.is_gloo_available():
        pytest.skip("torch without gloo")
    j = GlooJob(env)
    try:
        from stacklens.introspect.memory import ProcMem
        try:
            ProcMem(j.ranks[0]).close()
        except Exception as e:  # noqa: BLE001 - any refusal is a skip reason
            pytest.skip(f"cannot read a rank's memory here (need root / CAP_SYS_PTRACE): {e}")
        yield j
    finally:
        j.kill()


def _cli(env, *args: str) -> tuple[subprocess.CompletedProcess, float]:
    t0 = time.monotonic()
    r = subprocess.run([*STACKLENS, *args], capture_output=True, text=True, env=env, timeout=60)
    return r, time.monotonic() - t0


def _dump_in_collective(env, pid: int) -> dict:
    """Dump until rank 0's main thread is inside all_reduce (it prints 'ready' just before)."""
    deadline = time.monotonic() + 60
    while True:
        r, _ = _cli(env, "dump", "--json", str(pid))
        assert r.returncode == 0, r.stderr
        d = json.loads(r.stdout)
        main = next(t for t in d["threads"] if t["main"])
        if main["frames"] and main["frames"][0]["function"] == "all_reduce":
            return d
        assert time.monotonic() < deadline, f"rank 0 never seen in all_reduce: {main}"


def _rate(prog: list[tuple[int, float, float]]) -> tuple[float, float]:
    """Iterations per CPU second and per wall second: the medians over the progress intervals
    (one slow interval, another process's burst on the other core, does not decide)."""
    cpu = sorted((n1 - n0) / (c1 - c0) for (n0, c0, _), (n1, c1, _) in zip(prog, prog[1:]) if c1 > c0)
    wall = sorted((n1 - n0) / (w1 - w0) for (n0, _, w0), (n1, _, w1) in zip(prog, prog[1:]) if w1 > w0)
    return cpu[len(cpu) // 2], wall[len(wall) // 2]


def test_dump_of_a_rank_blocked_in_all_reduce(job, env):
    pid = job.ranks[0]
    d = _dump_in_collective(env, pid)
    main = next(t for t in d["threads"] if t["main"])
    assert main["tid"] == pid and main["consistent"]
    target = [f for f in main["frames"] if f["file"] == str(TARGET)]
    assert target[0]["function"] == "main" and target[0]["line"] == COLLECTIVE_LINE
    assert "distributed_c10d.py" in main["frames"][0]["file"]
    spinner = next(t for t in d["threads"] if t["frames"] and t["frames"][0]["function"] == "spin")
    assert d["gil"] in ("held", "released")
    assert not main["holds_gil"]            # all_reduce waits with the GIL released
    # the text form: the same line, within 1 s (best of three; each one printed on failure)
    times = []
    for _ in range(3):
        r, dt = _cli(env, "dump", str(pid))
        assert r.returncode == 0, r.stderr
        assert f"main ({TARGET}:{COLLECTIVE_LINE})" in r.stdout
        assert f"Thread {spinner['tid']} " in r.stdout
        times.append(dt)
    assert min(times) < 1.0, f"stacklens dump took {times} s"


def test_target_runs_at_its_former_speed_after_dumps(job, env):
    pid = job.ranks[0]
    _dump_in_collective(env, pid)
    job.drain()
    before = job.progress(8)
    for _ in range(5):
        r, _ = _cli(env, "dump", str(pid))
        assert r.returncode == 0, r.stderr
    job.drain()
    after = job.progress(8)
    cpu_before, wall_before = _rate(before)
    cpu_after, wall_after = _rate(after)
    print(f"iterations per CPU s: {cpu_before:.0f} before, {cpu_after:.0f} after; "
          f"per wall s: {wall_before:.0f} before, {wall_after:.0f} after")
    if not 0.75 < cpu_after / cpu_before < 1.33:
        # a slowdown the dumps left stays; one from the machine (CI ran 0.70x once, the other
        # core busy) passes: measured again, later
        cpu_after, _ = _rate(job.progress(16))
        print(f"again: {cpu_after:.0f} per CPU s")
    assert 0.75 < cpu_after / cpu_before < 1.33
    status = Path(f"/proc/{pid}/status").read_text()
    assert "TracerPid:\t0" in status                   # nothing left attached
    assert Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] in "RS"


def test_dump_job_names_the_missing_rank(job, env):
    _dump_in_collective(env, job.ranks[0])
    r, dt = _cli(env, "dump", "--job", "--json", str(job.proc.pid))
    assert r.returncode == 0, r.stderr
    j = json.loads(r.stdout)
    assert j["world_size"] == 2
    assert {x["rank"]: x["pid"] for x in j["ranks"]} == job.ranks
    assert j["waiting_in_collective"] == [0]
    assert [m["rank"] for m in j["missing"]] == [1]
    rank0 = next(x for x in j["ranks"] if x["rank"] == 0)
    assert rank0["collective"]["function"] == "all_reduce"
    assert rank0["caller"] == {"file": str(TARGET), "function": "main", "line": COLLECTIVE_LINE}
    r, _ = _cli(env, "dump", "--job", str(job.proc.pid))
    assert "MISSING rank 1:" in r.stdout, r.stdout
