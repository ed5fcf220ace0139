"""Sync waits as the target itself times them (issue 23 acceptance 3), on the GPU machine:

    python benchmarks/gpu/check_sync.py [--iters 200] [--json OUT]

A child launches a ~2 ms GEMM, then waits for it, in two loops on their own lines:
`torch.cuda.synchronize()` (libcuda 580: cuCtxSynchronize_v2) and `.item()` (a copy, then
cuStreamSynchronize). It times each wait call with perf_counter. stacklens (probes only) attaches
by PID; per loop line, `sync_wait_ns` must be within 5% of the child's own total.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

CHILD = r'''
import sys, time, json, torch
a = torch.randn(4096, 4096, device="cuda"); b = torch.randn(4096, 4096, device="cuda")
for _ in range(5):
    (a @ b).sum().item()
torch.cuda.synchronize()
print("ready", flush=True)
n = int(sys.stdin.readline())
spent = {"sync": 0.0, "item": 0.0}
for _ in range(n):
    c = a @ b
    t = time.perf_counter()
    torch.cuda.synchronize()  # SYNC_LINE
    spent["sync"] += time.perf_counter() - t
for _ in range(n):
    s = (a @ b).sum()
    t = time.perf_counter()
    s.item()  # ITEM_LINE
    spent["item"] += time.perf_counter() - t
print(json.dumps(spent), flush=True)
sys.stdin.readline()
'''


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    from stacklens.daemon.session import ProcessSession

    lines = {tag: i for i, text in enumerate(CHILD.splitlines(), 1)
             for tag in ("SYNC_LINE", "ITEM_LINE") if text.rstrip().endswith(tag)}
    p = subprocess.Popen([sys.executable, "-c", CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "ready"
    s = ProcessSession(p.pid)
    notes = s.start()
    try:
        p.stdin.write(f"{a.iters}\n")
        p.stdin.flush()
        spent = json.loads(p.stdout.readline())
        time.sleep(1.0)   # the ring drains within a poll interval; one more for the last batch
        snap = s.snapshot()
    finally:
        s.stop()
        p.stdin.write("\n")
        p.stdin.flush()
        p.wait(timeout=30)
    ours = {"sync": 0, "item": 0}
    apis: dict = {}
    for path, excl in snap.iter_paths():
        ns = excl.get("sync_wait_ns", 0)
        if not ns:
            continue
        line = next((f.line for f in path if f.kind == "python" and f.file == "<string>"
                     and f.line in lines.values()), None)
        key = "sync" if line == lines["SYNC_LINE"] else "item" if line == lines["ITEM_LINE"] else "other"
        ours[key] = ours.get(key, 0) + ns
        api = next((f.name for f in path if f.kind == "gpu_api"), "?")
        apis[f"{key}:{api}"] = apis.get(f"{key}:{api}", 0) + ns
    res = {"iters": a.iters, "target_s": spent, "ours_s": {k: v / 1e9 for k, v in ours.items()}, "by_api_s":
           {k: v / 1e9 for k, v in apis.items()}, "notes": [n for n in notes if "Synchronize" in n]}
    res["error"] = {k: (ours[k] / 1e9 - spent[k]) / spent[k] for k in ("sync", "item")}
    res["pass"] = all(abs(e) <= 0.05 for e in res["error"].values())
    print(json.dumps(res, indent=1))
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1))
    return 0 if res["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
