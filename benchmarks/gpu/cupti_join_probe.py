"""Can kernel records be joined to launches without CUPTI API records? (run on the GPU machine)

Kernel activity only (the API activity kinds leave a residual cost after detach; see
docs/benchmarks/gpu.md run 2), optionally with latency timestamps. Measures:
- whether kernel records carry correlation ids, and how they step from launch to launch;
- whether `queued` (host time the launch was queued, with latency timestamps) is populated, and
  where it falls relative to the host's own CLOCK_MONOTONIC stamps around each launch call;
- the launch-loop cost before / during / after, with and without latency timestamps.

    python benchmarks/gpu/cupti_join_probe.py [--json OUT]
"""

from __future__ import annotations

import json
import subprocess
import sys
import time


def child(latency: bool) -> dict:
    import torch
    from cupti import cupti

    x = torch.zeros(16, device="cuda")
    w = torch.randn(256, 256, device="cuda")

    def bench(steps=5000, reps=5):
        best = 1e9
        for _ in range(reps):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(steps):
                x.add_(1.0)
                x.mul_(0.5)
            torch.cuda.synchronize()
            best = min(best, (time.perf_counter() - t0) / steps * 1e6)
        return round(best, 3)

    torch.mm(w, w)
    torch.cuda.synchronize()
    out: dict = {"latency": latency, "before": bench()}
    recs: list = []
    K = cupti.ActivityKind

    def requested():
        return 1 << 20, 0

    def completed(acts):
        for r in acts:
            if r.kind == K.CONCURRENT_KERNEL:
                recs.append((int(r.correlation_id), int(r.start), int(r.end), int(getattr(r, "queued", 0) or 0),
                             int(getattr(r, "submitted", 0) or 0), int(r.grid_x), int(r.block_x), str(r.name)[:60]))

    cupti.activity_register_callbacks(requested, completed)
    if latency:
        try:
            cupti.activity_enable_latency_timestamps(1)
            out["latency_enabled"] = True
        except Exception as e:  # noqa: BLE001
            out["latency_enabled"] = repr(e)
    cupti.activity_enable(K.CONCURRENT_KERNEL)
    out["during"] = bench()
    cupti.activity_flush_all(1)
    recs.clear()
    # clock calibration: tightest (mono, cupti, mono)
    best = None
    for _ in range(20):
        a = time.monotonic_ns()
        d = cupti.get_timestamp()
        b = time.monotonic_ns()
        if best is None or b - a < best[0]:
            best = (b - a, (a + b) // 2 - d)
    off = best[1]
    out["calib_uncertainty_ns"] = best[0] // 2
    host = []
    for i in range(200):
        if i % 10 == 5:
            t0 = time.monotonic_ns()
            torch.mm(w, w)
            t1 = time.monotonic_ns()
            host.append(("mm", t0, t1))
        else:
            t0 = time.monotonic_ns()
            x.add_(1.0)
            t1 = time.monotonic_ns()
            host.append(("add", t0, t1))
    torch.cuda.synchronize()
    cupti.activity_flush_all(1)
    recs.sort()
    out["n_host"] = len(host)
    out["n_kernels"] = len(recs)
    corr = [r[0] for r in recs]
    out["corr_first"] = corr[:5]
    out["corr_steps"] = sorted(set(b - a for a, b in zip(corr, corr[1:])))[:20]
    out["names_first"] = [r[7] for r in recs[:12]]
    deltas, inside = [], 0
    if len(recs) == len(host):
        for (kind, t0, t1), r in zip(host, recs):
            q = r[3]
            if q:
                qm = q + off
                deltas.append((qm - t0, t1 - qm))
                inside += t0 - 2000 <= qm <= t1 + 2000
    out["queued_populated"] = sum(1 for r in recs if r[3])
    out["queued_inside_host_call"] = inside
    if deltas:
        d0 = sorted(d[0] for d in deltas)
        d1 = sorted(d[1] for d in deltas)
        out["queued_minus_call_start_ns"] = [d0[0], d0[len(d0) // 2], d0[-1]]
        out["call_end_minus_queued_ns"] = [d1[0], d1[len(d1) // 2], d1[-1]]
    starts = [r[1] + off - h[1] for h, r in zip(host, recs)] if len(recs) == len(host) else []
    if starts:
        s = sorted(starts)
        out["kernel_start_minus_call_start_ns"] = [s[0], s[len(s) // 2], s[-1]]
    cupti.activity_disable(K.CONCURRENT_KERNEL)
    cupti.activity_flush_all(1)
    out["after"] = bench()
    time.sleep(2.0)
    out["after_2s"] = bench()
    for k in ("during", "after", "after_2s"):
        out[k + "_x"] = round(out[k] / out["before"], 3)
    return out


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        print("RESULT " + json.dumps(child(sys.argv[2] == "1")), flush=True)
        return
    res = {}
    for lat in ("0", "1", "0", "1"):
        p = subprocess.run([sys.executable, __file__, "--child", lat], capture_output=True, text=True, timeout=120)
        line = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
        r = json.loads(line[0][7:]) if line else {"error": p.stderr[-1500:]}
        res.setdefault("latency" if lat == "1" else "plain", []).append(r)
        print("latency" if lat == "1" else "plain", json.dumps(r), flush=True)
    if len(sys.argv) > 2 and sys.argv[1] == "--json":
        with open(sys.argv[2], "w") as f:
            json.dump(res, f, indent=2)


if __name__ == "__main__":
    main()
