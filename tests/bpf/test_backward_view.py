"""Issue 30, acceptance 3, on a real CPU training loop (root + eBPF): the caller view
(cct/backwardview.py) puts backward work under `loss.backward()` in the share py-spy gives that
line on the same process over the same window (within 3 points); the default view still puts it
on the forward lines (what the link is for) and renders as before.

Both profilers run at once at RATE, as in test_pprof_pyspy.py (its notes on nice and SCHED_FIFO
apply here), but py-spy without `--gil`: the autograd engine runs backward with the GIL released,
so `--gil` drops it (py-spy said 20.2% where the caller view said 43.8%; without it 43.0 vs 43.3).
py-spy's share is its samples with a `loss.backward()` line of
tests/targets/torch_train.py on the stack; stacklens' is the inclusive CPU samples of those lines
between two snapshots (py-spy's start and its exit). At MIN_SAMPLES each, the difference of two
sampled shares near 40% has a standard deviation of 1.1 points: 3 points is 2.7 of them. py-spy
samples wall time and stacklens CPU time: the time the target waited for a CPU (its main thread's
wall time off-CPU; the loop never sleeps), which only py-spy sees, widens the bound by its share
(measured: 5% beside py-spy and the daemon on 2 vCPUs; under two CPU hogs the caller view was 3.7
points off py-spy against a bound of 3.4 without it).
"""

from __future__ import annotations

import math
import os
import re
import time
from collections import Counter
from pathlib import Path

import pytest

from stacklens.cct.backwardview import caller_view
from stacklens.daemon.session import ProcessSession
from stacklens.introspect.procfs import ProcFS

from tests.bpf.pyspy import py_spy, record_beside

pytestmark = pytest.mark.bpf

RATE = 999
MIN_SAMPLES = 4000
TARGET = Path(__file__).resolve().parents[1] / "targets" / "torch_train.py"
STEPS = ("step_big", "step_small")


def backward_lines() -> set[int]:
    return {i for i, text in enumerate(TARGET.read_text().splitlines(), 1) if text.strip() == "loss.backward()"}


def under(snap, lines: set[int]) -> int:
    """CPU samples with a `loss.backward()` line of the target on the stack (inclusive)."""
    return sum(snap.inclusive(n, "cpu_samples") for n in range(1, snap.node_count)
               for f in [snap.frame_of(n)]
               if f.kind == "python" and f.name in STEPS and f.line in lines and f.file.endswith("torch_train.py"))


def pyspy_share(raw: Path, lines: set[int]) -> tuple[float, int]:
    frame = re.compile(r"\b(?:" + "|".join(STEPS) + r") \([^)]*torch_train\.py:(\d+)\)")
    n_all = n_in = 0
    for line in raw.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        n_all += int(n)
        if any(int(m) in lines for m in frame.findall(stack)):
            n_in += int(n)
    return 100 * n_in / n_all, n_all


@pytest.mark.timeout(900)   # the BPF compile and 4,000 samples on a shared 2-core machine
def test_caller_view_matches_py_spy_under_loss_backward(bpf_ok, start_target, tmp_path):
    pyspy = py_spy()
    lines = backward_lines()
    assert len(lines) == 2, lines
    # one intra-op thread: py-spy sees Python threads only, stacklens every thread's CPU
    t = start_target("torch_train.py", env=dict(os.environ, OMP_NUM_THREADS="1"))
    session = ProcessSession(t.pid, cpu_hz=RATE)
    raw = tmp_path / "pyspy.txt"
    marks: list[tuple[float, float]] = []   # (wall, the main thread's CPU seconds) at the window's ends

    def mark() -> None:
        fields = ProcFS().stat(t.pid, t.pid)[1]
        marks.append((time.monotonic(), (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")))

    try:
        notes = session.start(window=True)
        assert any(n.startswith("backward link: on") for n in notes), notes
        for tid in ProcFS().tasks(t.pid):
            os.setpriority(os.PRIO_PROCESS, tid, -20)
        before, after = record_beside(pyspy, session, raw, rate=RATE, min_samples=MIN_SAMPLES, timeout_s=300,
                                      gil=False, mark=mark)   # not --gil: backward runs with the GIL released
    finally:
        session.stop()
    theirs, n_theirs = pyspy_share(raw, lines)
    n_ours = after.total("cpu_samples") - before.total("cpu_samples")
    caller = 100 * (under(caller_view(after), lines) - under(caller_view(before), lines)) / n_ours
    forward = 100 * (under(after, lines) - under(before, lines)) / n_ours
    backward = Counter()
    for path, excl in after.iter_paths():
        # on a model line (a forward, or the loss: `F.mse_loss`'s node is on the step's line), or
        # under the backward call, left there (AccumulateGrad has no forward op)
        kind = next((("under the backward call" if any(f.kind == "python" and f.name == "_engine_run_backward"
                                                       for f in path[:i]) else "under forward line")
                     for i, f in enumerate(path) if f.kind == "backward"), None)
        if kind:
            backward[kind] += excl.get("cpu_samples", 0)
    # the loop never sleeps: the main thread's wall time off its CPU is time it waited for one
    waited = max(0.0, 1 - (marks[1][1] - marks[0][1]) / (marks[1][0] - marks[0][0]))
    got = {"py-spy": (round(theirs, 1), n_theirs), "caller view": (round(caller, 1), n_ours),
           "waited for a CPU": round(waited, 3),
           "forward view": round(forward, 1), "backward samples": dict(backward),
           "moved": caller_view(after).meta["backward_view_moved"]}
    print(f"\n{got}")
    assert n_ours >= MIN_SAMPLES and n_theirs >= MIN_SAMPLES / 2, got
    assert theirs > 20, got                                   # the loop does spend its time in backward
    # two samplings of one split, each off by its sampling error: 3 points, or 3.5 standard errors
    # of the difference of the two proportions where py-spy got fewer samples (a loaded machine);
    # and two clocks: py-spy samples wall time, stacklens CPU time, so while the target waits for
    # a CPU (a busy machine) only py-spy samples it, in whichever phase it waits: the shares may
    # part by up to the share of the window it waited
    p = theirs / 100
    se = 100 * math.sqrt(p * (1 - p) * (1 / n_theirs + 1 / n_ours))
    assert abs(caller - theirs) <= max(3.0, 3.5 * se) + 100 * waited, (got, se)
    # the default view as the link makes it: backward work on the forward (model) lines
    assert forward < theirs / 2, got
    assert backward["under forward line"] > 4 * backward["under the backward call"], got
    assert "backward_view" not in after.meta and "backward_callers" in after.meta
