"""The backward link over a long run (issue 18 acceptance 4): profile size and the link's table
stay constant while a CPU training loop runs (tests/targets/backward_ratio.py).

    sudo .venv/bin/python benchmarks/bench_backward_soak.py [--minutes 10] [--every 30]

Prints one JSON line per sample: elapsed s, tree nodes, encoded profile bytes, the forward
table's size, nodes linked so far, daemon RSS.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def rss_mib() -> float:
    with open("/proc/self/status") as fh:
        return next(int(ln.split()[1]) for ln in fh if ln.startswith("VmRSS:")) / 1024


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--minutes", type=float, default=10)
    ap.add_argument("--every", type=float, default=30)
    a = ap.parse_args(argv)
    from stacklens.cct.export import encode_profile
    from stacklens.daemon.session import ProcessSession

    p = subprocess.Popen([sys.executable, str(REPO / "tests/targets/backward_ratio.py")], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "ready"
    s = ProcessSession(p.pid, cpu_hz=99)
    s.start()
    t0 = time.monotonic()
    rows = []
    try:
        while time.monotonic() - t0 < a.minutes * 60:
            time.sleep(a.every)
            snap = s.snapshot()
            st = s.stats()
            row = {"t_s": round(time.monotonic() - t0), "nodes": snap.node_count,
                   "profile_bytes": len(encode_profile(snap)), "forward_table": st.get("autograd_forward_table"),
                   "linked": st.get("autograd_linked"), "cpu_samples": snap.total("cpu_samples"),
                   "rss_mib": round(rss_mib(), 1)}
            rows.append(row)
            print(json.dumps(row), flush=True)
    finally:
        s.stop()
        p.kill()
    first, last = rows[len(rows) // 3], rows[-1]
    print(json.dumps({"nodes_growth_after_first_third": last["nodes"] - first["nodes"],
                      "bytes_ratio_last_to_third": round(last["profile_bytes"] / first["profile_bytes"], 3),
                      "forward_table_max": max(r["forward_table"] or 0 for r in rows)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
