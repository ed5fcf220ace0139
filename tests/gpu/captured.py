"""Issue 27 acceptance 2 (GPU, root; run by hand on the GPU machine, not collected by pytest):

    python tests/gpu/captured.py [--replays 200] [--out report.json]

An eager four-block model replayed as a manual ``torch.cuda.graph`` (tests/targets/graph_replay.py),
attached by PID with probes and the agent, twice:
- **before capture**: attached, then the graph captured and replayed; the window (diff of the
  snapshots around the replays) must hold >= 95% of the replays' GPU time (paths through
  ``api:cuGraphLaunch``) under ``[graph]`` on a captured line: the innermost Python frame below
  the marker is a ``# MODEL_LINE`` line of the target;
- **after capture**: a process that captured before the attach: 100% of the replays' GPU time
  under ``[graph: captured before attach]`` with each kernel named (no ``unresolved:`` name).
Prints a JSON report; exit 0 when both hold.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from stacklens.cct import diff
from stacklens.daemon.session import ProcessSession

TARGET = Path(__file__).resolve().parents[1] / "targets" / "graph_replay.py"
BEFORE_MIN = 0.95


def model_lines() -> set[int]:
    return {i for i, line in enumerate(TARGET.read_text().splitlines(), 1) if line.rstrip().endswith("# MODEL_LINE")}


def replay_split(window, lines: set[int]) -> dict:
    """GPU ns of graph replays: total, under [graph] on a model line, under [graph: captured
    before attach] (and of those, named), elsewhere."""
    out = {"replay_ns": 0, "on_captured_line_ns": 0, "before_attach_ns": 0, "before_attach_named_ns": 0,
           "graph_marker_other_ns": 0}
    target = str(TARGET)
    for path, m in window.iter_paths():
        g = m.get("gpu_time_ns", 0)
        if g <= 0 or not any(f.kind == "gpu_api" and f.name.startswith("cuGraphLaunch") for f in path):
            continue
        out["replay_ns"] += g
        mark = next((i for i, f in enumerate(path) if f.kind == "other" and f.name.startswith("graph")), None)
        if mark is None:
            continue
        below = path[mark + 1:]
        if path[mark].name == "graph":
            py = [f for f in below if f.kind == "python" and f.file == target]
            if py and py[-1].line in lines:
                out["on_captured_line_ns"] += g
            else:
                out["graph_marker_other_ns"] += g
        elif path[mark].name == "graph: captured before attach":
            out["before_attach_ns"] += g
            if path[-1].kind == "kernel" and not path[-1].name.startswith("unresolved:"):
                out["before_attach_named_ns"] += g
    return out


def run(case: str, replays: int) -> dict:
    argv = [sys.executable, str(TARGET)] + (["--capture-now"] if case == "after" else [])
    p = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def cmd(line: str) -> None:
        p.stdin.write(line + "\n")
        p.stdin.flush()
        assert p.stdout.readline().strip() == "done", f"target failed on {line!r}"

    try:
        assert p.stdout.readline().strip() == "ready", "target did not start"
        s = ProcessSession(p.pid, agent=True)
        s.start()
        try:
            if case == "before":
                cmd("capture")
            cmd("replay 5")                     # primer: the first replay settles the nodes
            time.sleep(2)
            a = s.snapshot()
            cmd(f"replay {replays}")
            time.sleep(3)                        # the last kernel records
        finally:
            s.stop()
        b = s.snapshot()       # after the detach's forced flush (graph kernels wait for a full buffer)
        stats = s.joiner.stats.as_dict()
        p.stdin.write("quit\n")
        p.stdin.flush()
    finally:
        if p.poll() is None:
            p.kill()
    r = replay_split(diff(b, a), model_lines())
    r["graphs"] = b.meta.get("graphs")
    r["join_stats"] = stats
    return r


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--replays", type=int, default=200)
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    before = run("before", a.replays)
    after = run("after", a.replays)
    share_before = before["on_captured_line_ns"] / before["replay_ns"] if before["replay_ns"] else 0.0
    share_after = after["before_attach_named_ns"] / after["replay_ns"] if after["replay_ns"] else 0.0
    report = {"before": before, "after": after, "share_on_captured_lines": share_before,
              "share_named_before_attach": share_after,
              "ok": share_before >= BEFORE_MIN and share_after >= 1.0 - 1e-9}
    text = json.dumps(report, indent=2)
    print(text)
    if a.out:
        Path(a.out).write_text(text)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
