"""Issue 21 acceptance 1 (GPU, root; run by hand on the GPU machine, not collected by pytest):

    .venv/bin/python tests/gpu/compiled.py [--steps 20] [--out report.json]

A torch.compile'd (default mode) training step of four transformer blocks
(tests/targets/compiled_transformer.py) is attached by PID after it compiled, with probes and the
agent. Snapshot A, K steps, snapshot B; the window is diff(B, A). Reported:
- **share**: GPU time under an ``op:[compiled …]`` frame whose innermost Python frame above it is in
  the model's file, over all GPU time of the window (acceptance: >= 0.90);
- **per line**: that GPU time per model line, against torch.profiler's GPU time of K steps of the
  same process after the detach (``with_stack``), linked to source by the same provenance: each
  profiled kernel -> the wrapper line in the Python stack of the op that launched it -> the maps
  stacklens built (``joiner.compiled``) -> its model line; acceptance: every line within 5%
  (lines under 1% of the total are listed, not judged).
Prints a JSON report; exit 0 when both hold. Inductor's cache goes to a fresh directory, so the
line map's stack traces are this run's.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from stacklens.cct import diff
from stacklens.daemon.session import ProcessSession

TARGET = Path(__file__).resolve().parents[1] / "targets" / "compiled_transformer.py"
SHARE_MIN = 0.90
LINE_TOLERANCE = 0.05
SMALL = 0.01


def model_line(path, model_file: str) -> int | None:
    """The model line a compiled charge sits on: the innermost python frame of the model file
    above the innermost op:[compiled …] frame; None if the path has no such pair."""
    ops = [i for i, f in enumerate(path) if f.kind == "op" and f.name.startswith("[compiled")]
    if not ops:
        return None
    py = [f for f in path[:ops[-1]] if f.kind == "python" and f.file == model_file]
    return py[-1].line if py else None


def stacklens_lines(window, model_file: str) -> tuple[dict[int, int], int]:
    per_line: dict[int, int] = collections.Counter()
    total = 0
    for path, m in window.iter_paths():
        g = m.get("gpu_time_ns", 0)
        if g <= 0:
            continue
        total += g
        ln = model_line(path, model_file)
        if ln is not None:
            per_line[ln] += g
    return dict(per_line), total


def profiler_lines(sites: list, index, model_file: str) -> tuple[dict[int, float], int, int]:
    """torch.profiler's kernel times on model lines through the same wrapper maps: each kernel's
    launching wrapper line (the target's `kernel_sites`) -> `WrapperMap.at` -> the innermost
    frame of the model file. Returns (per line, total ns, ns of kernels with no wrapper line)."""
    per_line: dict[int, float] = collections.Counter()
    total = unlinked = 0
    for _name, file, line, ns in sites:
        total += ns
        m = index.modules.get(file) if index is not None else None
        hit = m.at(line) if m is not None else None
        py = [f for f in hit[0] if f.file == model_file] if hit else []
        if py:
            per_line[py[-1].line] += ns
        else:
            unlinked += ns
    return dict(per_line), total, unlinked


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    cache = tempfile.mkdtemp(prefix="inductor-")
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache)
    p = subprocess.Popen([sys.executable, str(TARGET)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                         env=env)

    def cmd(line: str) -> None:
        p.stdin.write(line + "\n")
        p.stdin.flush()
        assert p.stdout.readline().strip() == "done", f"target failed on {line!r}"

    try:
        assert p.stdout.readline().strip() == "ready", "target did not start"
        s = ProcessSession(p.pid, agent=True)
        s.start()
        try:
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline and s.snapshot().meta.get("inductor", {}).get("modules", 0) < 2:
                cmd("steps 1")
                time.sleep(0.5)
            cmd("steps 3")                       # primer: records flow
            time.sleep(2)
            a = s.snapshot()
            cmd(f"steps {args.steps}")
            time.sleep(3)                        # the last kernel records
            b = s.snapshot()
            index = s.joiner.compiled
        finally:
            s.stop()
        prof = os.path.join(cache, "profile.json")
        cmd(f"profile {args.steps} {prof}")
        cmd("quit")
        sites = json.loads(Path(prof).read_text())
    finally:
        if p.poll() is None:
            p.kill()
    model = str(TARGET)
    ours, total = stacklens_lines(diff(b, a), model)
    theirs, ptotal, unlinked = profiler_lines(sites, index, model)
    share = sum(ours.values()) / total if total else 0.0
    lines = {}
    ok = share >= SHARE_MIN
    for ln in sorted(set(ours) | set(theirs)):
        o, t = ours.get(ln, 0), theirs.get(ln, 0.0)
        small = t < SMALL * ptotal
        rel = abs(o - t) / t if t else None
        within = small or (rel is not None and rel <= LINE_TOLERANCE)
        ok = ok and within
        lines[ln] = {"stacklens_ns": o, "profiler_ns": round(t), "rel_diff": rel, "judged": not small, "ok": within}
    report = {"steps": args.steps, "gpu_ns": total, "profiler_gpu_ns": ptotal, "profiler_unlinked_ns": unlinked, "share_on_model_lines": share,
              "share_min": SHARE_MIN, "lines": lines, "inductor": b.meta.get("inductor"), "ok": ok}
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
