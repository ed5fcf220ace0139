"""The forward→backward link on a real CPU training loop (BPF as root): backward CPU samples
carry the forward line and the autograd node, in the ratio the target measures itself."""

from __future__ import annotations

import collections
import json
import time
from pathlib import Path

import pytest

from stacklens.daemon.session import ProcessSession

from tests.bpf.conftest import Target

pytestmark = pytest.mark.bpf

SAMPLE_HZ = 997
# backward samples of the cheaper layer: the ratio's sampling error is sqrt(1/n_small + 1/n_big),
# 3.2% at 1,500 and 3,000: the 10% bound is 3 standard deviations (at 300 it was 1.4, and failed)
ENOUGH = 1500
PATIENCE_S = 300      # only a bound for a machine that never gets there; the loop waits on samples


def _backward_by_line(snap, file_tag: str) -> collections.Counter:
    """cpu_samples by (backward node, line of the target's forward) over every path."""
    out: collections.Counter = collections.Counter()
    for node in range(1, snap.node_count):
        n = snap.exclusive(node, "cpu_samples")
        if not n:
            continue
        path = snap.path(node)
        bwd = next((f.name for f in path if f.kind == "backward"), "-")
        line = next((f.line for f in path if f.kind == "python" and file_tag in f.file
                     and f.name.endswith("forward")), 0)
        out[(bwd, line)] += n
    return out


def test_backward_samples_carry_the_forward_line_and_node(bpf_ok):
    t = Target("backward_ratio.py")
    try:
        t.send("info")
        info = json.loads(t.readline())
        s = ProcessSession(t.pid, cpu_hz=SAMPLE_HZ)
        notes = s.start()
        assert any(n.startswith("backward link: on") for n in notes), notes
        try:
            deadline = time.monotonic() + PATIENCE_S
            while True:
                by = _backward_by_line(s.snapshot(), "backward_ratio.py")
                if by[("AddmmBackward0", info["line_small"])] >= ENOUGH or time.monotonic() > deadline:
                    break
                time.sleep(1.0)
            snap = s.snapshot()
        finally:
            s.stop()
    finally:
        t.proc.kill()
    small = by[("AddmmBackward0", info["line_small"])]
    big = by[("AddmmBackward0", info["line_big"])]
    assert small >= ENOUGH, f"only {small} backward samples of the small layer: {by}"
    ratio = big / small
    # 3.5 sigma of the two errors: the sample counts' (Poisson, relative variance 1/big + 1/small)
    # and the target's own measure of the ratio (its standard error over blocks of steps)
    bound = 3.5 * (1 / big + 1 / small + (info["backward_ratio_se"] / info["backward_ratio"]) ** 2) ** 0.5
    assert abs(ratio / info["backward_ratio"] - 1) <= bound, (ratio, bound, info, by)
    # every linked backward sample sits under a line of the model; only nodes without a forward
    # op (AccumulateGrad) or created before the attach may sit elsewhere
    linked = sum(n for (bwd, line), n in by.items() if bwd not in ("-", "AccumulateGrad") and line)
    stray = sum(n for (bwd, line), n in by.items() if bwd not in ("-", "AccumulateGrad") and not line)
    assert stray <= 0.02 * linked, by
    link = snap.meta["backward_link"]
    assert link["autograd_linked"] > 0 and link["autograd_no_forward"] > 0, link
    # the forward of each layer is there too, apart from its backward
    assert by[("-", info["line_big"])] > 0 and by[("-", info["line_small"])] > 0


def _line(tag: str) -> int:
    path = Path(__file__).resolve().parents[1] / "targets" / "backward_checkpoint.py"
    return next(i for i, text in enumerate(path.read_text().splitlines(), 1) if text.rstrip().endswith(tag))


def test_reentrant_backward_nests_nodes(bpf_ok):
    """The checkpointed block's nodes are current while they run, inside the outer PyNode, and
    linked to the recomputation's forward line; the PyNode's own work sits under the line that
    called checkpoint()."""
    t = Target("backward_checkpoint.py")
    try:
        s = ProcessSession(t.pid, cpu_hz=SAMPLE_HZ)
        s.start()
        try:
            deadline = time.monotonic() + PATIENCE_S
            while True:
                by = collections.Counter()
                for path, excl in s.snapshot().iter_paths():
                    n = excl.get("cpu_samples", 0)
                    bwd = next((f.name for f in path if f.kind == "backward"), "-")
                    lines = tuple(f.line for f in path if f.kind == "python" and f.file.endswith("backward_checkpoint.py"))
                    by[(bwd, lines[-1] if lines else 0)] += n
                if by[("AddmmBackward0", _line("# BLOCK_LINE"))] >= 50 or time.monotonic() > deadline:
                    break
                time.sleep(1.0)
        finally:
            s.stop()
    finally:
        t.proc.kill()
    assert by[("AddmmBackward0", _line("# BLOCK_LINE"))] >= 50, by     # the inner nodes, linked
    assert by[("AddmmBackward0", _line("# OUTER_LINE"))] > 0, by       # the outer layer's node
    assert by[("PyNode", _line("# CHECKPOINT_LINE"))] > 0, by          # the outer node itself
