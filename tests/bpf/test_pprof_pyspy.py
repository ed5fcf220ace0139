"""Issue 22 acceptance 1 on a real target (root + eBPF): stacklens' pprof of tests/targets/stages.py
read by `go tool pprof -top` has the same top 3 as py-spy's profile of the same process over the
same window, each share within 2 points of the target's own account of its CPU time (the truth;
tests/targets/stages.py counts each stage's thread CPU time) and as close to py-spy's as two
samplers can be (4 standard deviations of the difference of two sampled shares: ±4 points at
3,000 samples each; CI saw py-spy 2.5 points off at 46.0% where the truth and stacklens said
48.5%); `-tagfocus=thread=NAME` keeps one thread's functions.

Both profilers run at once, at RATE: py-spy (process_vm_readv, --nonblocking: the target is never
stopped) and stacklens' CPU samples; the comparison window is what stacklens counted between
py-spy's start and its exit (two snapshots), and it ends once stacklens has MIN_SAMPLES there.
What makes the two agree on a busy machine (numbers: docs/benchmarks/pprof.md):
- py-spy samples wall time, stacklens CPU time: the target runs at nice -20 once attached (not
  before: it starved BPF's compile, 71 s), so preemption, which a wall-clock sampler charges to
  wherever the thread stood, stays rare;
- py-spy runs at SCHED_FIFO: starved, it took its samples in bursts of one instant (a stage at
  65% in one 2 s run);
- `--gil`: py-spy counts a thread waiting for the GIL as active (the logger thread's wait after
  each sleep: 12.6% of samples at its `time.sleep` line), stacklens only what runs.
"""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
from collections import Counter
from pathlib import Path

from stacklens.cct import diff
from stacklens.render.pprof import to_pprof
from stacklens.daemon.session import ProcessSession
from stacklens.introspect.procfs import ProcFS

from tests.bpf.pyspy import py_spy, record_beside, tool, wait_until

RATE = 999          # Hz, both profilers
MIN_SAMPLES = 3000  # stacklens' in the window (py-spy, at wall time, has more)
STAGES = ("encoder", "preprocess", "head")


def pyspy_shares(raw: Path) -> tuple[dict[str, float], int]:
    """Innermost-function shares (%) of a `py-spy record --format raw` file, largest first, and
    its sample count."""
    counts: Counter = Counter()
    for line in raw.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        counts[stack.rpartition(";")[2].partition(" (")[0]] += int(n)
    total = sum(counts.values())
    return {f: 100 * n / total for f, n in counts.most_common()}, total


def sampled_difference(share: float, n1: int, n2: int, sds: float = 4.0) -> float:
    """The bound (points) on the difference of one share (%) measured by two samplers of n1 and
    n2 samples: `sds` standard deviations of the difference of two binomial proportions."""
    p = share / 100
    return 100 * sds * math.sqrt(p * (1 - p) * (1 / n1 + 1 / n2))


def pprof_top(go: str, home: Path, profile: Path, *args: str) -> list[tuple[int, str]]:
    """(flat samples, function) rows of `go tool pprof -top`, flat > 0, largest first."""
    r = subprocess.run([go, "tool", "pprof", "-top", "-sample_index=samples", *args, str(profile)],
                       capture_output=True, text=True, timeout=120,
                       env={"HOME": str(home), "PATH": "/usr/bin:/bin", "GOCACHE": str(home / "gocache")})
    assert r.returncode == 0, r.stderr
    rows = [ln.split() for ln in r.stdout.splitlines() if re.match(r"^\s*\d+\s+\d", ln)]
    return [(int(row[0]), row[-1]) for row in rows if row[0] != "0"]


def test_pprof_agrees_with_py_spy_and_focuses_on_threads(bpf_available, start_target, tmp_path):
    pyspy = py_spy()
    go = tool("go", "Debian: apt-get install golang-go")
    truth = tmp_path / "truth.jsonl"
    t = start_target("stages.py", str(truth))
    session = ProcessSession(t.pid, agent=False, cpu_hz=RATE, ops=False)
    raw = tmp_path / "pyspy.txt"
    try:
        session.start(window=True)
        for tid in ProcFS().tasks(t.pid):
            os.setpriority(os.PRIO_PROCESS, tid, -20)   # nice is per thread
        # SIGUSR1 starts and ends the target's account of the window
        before, after = record_beside(pyspy, session, raw, rate=RATE, min_samples=MIN_SAMPLES, timeout_s=120,
                                      mark=lambda: os.kill(t.pid, signal.SIGUSR1))
        wait_until(lambda: truth.exists() and truth.read_text().count("\n") == 2, timeout_s=60,
                   what="target's account of its window")
    finally:
        session.stop()
    theirs, n_theirs = pyspy_shares(raw)
    window = diff(after, before)
    profile = tmp_path / "window.pb.gz"
    profile.write_bytes(to_pprof(window))
    rows = pprof_top(go, tmp_path, profile)
    n_ours = sum(n for n, _ in rows)
    ours = {fn.removeprefix("stages."): 100 * n / n_ours for n, fn in rows}
    start, end = (json.loads(ln) for ln in truth.read_text().splitlines())
    cpu = {f: end[f] - start[f] for f in end}
    true = {f: 100 * s / sum(cpu.values()) for f, s in cpu.items()}
    got = {"stacklens": (n_ours, ours), "py-spy": (n_theirs, theirs), "truth": (sum(cpu.values()), true)}
    print(f"\n{got}")
    # the window's own count (`-top` leaves out nodes under 0.5% of the total: CI saw 2,988 rows' worth)
    assert window.total("cpu_samples") >= MIN_SAMPLES and n_theirs >= MIN_SAMPLES / 2, got   # py-spy kept up
    assert list(ours)[:3] == list(theirs)[:3] == list(STAGES), got
    assert all(abs(ours[f] - true[f]) <= 2.0 for f in STAGES), got
    assert all(abs(ours[f] - theirs[f]) <= sampled_difference(ours[f], n_ours, n_theirs) for f in STAGES), got

    # one thread's own functions only (and now and then its loop's line, or libc below it)
    profile.write_bytes(to_pprof(after))     # the thread names are in the whole profile's meta
    pipeline = [fn for _, fn in pprof_top(go, tmp_path, profile, "-tagfocus=thread=pipeline")]
    logger = [fn for _, fn in pprof_top(go, tmp_path, profile, "-tagfocus=thread=logger")]
    stages = {f"stages.{f}" for f in STAGES}
    assert pipeline[:3] == [f"stages.{f}" for f in STAGES] and "stages.log_metrics" not in pipeline, pipeline
    assert logger[0] == "stages.log_metrics" and not stages & set(logger), logger
