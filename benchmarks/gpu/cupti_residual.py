"""Which CUPTI activity kinds slow a launch-bound torch loop during and *after* collection?

Each configuration runs in a fresh process (CUPTI state is per process): the launch loop is timed
before, while the kinds are enabled, and after they are disabled and flushed (immediately and
after 2 s). It also counts the records of a known kernel sequence that come back from the forced
flush (synchronously, and after a short wait). Run on the GPU machine with cupti-python:

    python benchmarks/gpu/cupti_residual.py [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

CONFIGS = {
    "no_cupti": None,          # control: the same process steps, CUPTI never imported
    "callbacks_only": [],
    "kernel": ["CONCURRENT_KERNEL"],
    "kernel_memcpy": ["CONCURRENT_KERNEL", "MEMCPY", "MEMSET"],
    "runtime_launch": ["RUNTIME"],
    "driver_launch": ["DRIVER"],
    "all_launch": ["CONCURRENT_KERNEL", "MEMCPY", "MEMSET", "RUNTIME", "DRIVER"],
    "runtime_all_cbids": ["RUNTIME*"],
    # the agent's default path: kernel/copy activity, buffers handed over raw through its ctypes
    # callbacks (no Python object per record) — CUPTI's own cost with the least work on our side
    "kernel_raw": ["RAW", "CONCURRENT_KERNEL", "MEMCPY", "MEMSET"],
}


def _bench(torch, x, steps=5000, reps=5) -> float:
    """The launch loop: best of reps, µs per step of two tiny kernels."""
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


def child(kinds: list[str] | None) -> dict:
    """One configuration's timeline. kinds None: the control, the same timeline with no CUPTI at all
    (how much "after" moves on its own). RAW first: buffers through the agent's ctypes callbacks,
    counted in bytes (`records.raw_bytes`; no per-record parse, so `seq_kernels_*` are null)."""
    import torch
    if kinds is not None:
        from cupti import cupti

    x = torch.zeros(16, device="cuda")

    def bench():
        return _bench(torch, x)

    if kinds is None:
        out = {"before": bench(), "during": bench()}
        got = None
        time.sleep(0.5)
    else:
        w = torch.randn(512, 512, device="cuda")

        def seq():
            for _ in range(200):
                x.add_(1.0)
            for _ in range(50):
                torch.mm(w, w)
            torch.cuda.synchronize()

        seq()
        out = {"before": bench()}
        raw = kinds[:1] == ["RAW"]
        if raw:
            import os

            from stacklens.inject.agent.gpu.cupti_raw import _ctypes_callbacks
            from stacklens.inject.agent.gpu import mapped_libraries
            kinds = kinds[1:]
            got = {"buffers": 0, "raw_bytes": 0}
            cupti.get_timestamp()                  # libcupti mapped by now
            lib = sorted(p for p in mapped_libraries() if "libcupti" in os.path.basename(p))[0]

            def on_buffer(data, offs):
                got["buffers"] += 1
                got["raw_bytes"] += len(data)

            flush = _ctypes_callbacks(lib, on_buffer, lambda: False).flush_all
            got["lib"] = os.path.basename(lib)
        else:
            got = {"kernel": 0, "api": 0, "other": 0, "buffers": 0}

            def requested():
                return 1 << 20, 0

            def completed(acts):
                got["buffers"] += 1
                for r in acts:
                    if r.kind == cupti.ActivityKind.CONCURRENT_KERNEL:
                        got["kernel"] += 1
                    elif r.kind in (cupti.ActivityKind.RUNTIME, cupti.ActivityKind.DRIVER):
                        got["api"] += 1
                    else:
                        got["other"] += 1

            cupti.activity_register_callbacks(requested, completed)
            flush = cupti.activity_flush_all
        enabled = []
        for k in kinds:
            name = k.rstrip("*")
            kind = getattr(cupti.ActivityKind, name)
            cupti.activity_enable(kind)
            enabled.append(kind)
            if name in ("RUNTIME", "DRIVER") and not k.endswith("*"):
                en = cupti.activity_enable_runtime_api if name == "RUNTIME" else cupti.activity_enable_driver_api
                dom = cupti.CallbackDomain.RUNTIME_API if name == "RUNTIME" else cupti.CallbackDomain.DRIVER_API
                for cbid in range(1, 2048):
                    try:
                        nm = str(cupti.get_callback_name(dom, cbid))
                    except Exception:
                        continue
                    en(cbid, 1 if "Launch" in nm else 0)
        out["during"] = bench()
        flush(1)
        base = dict(got)
        seq()
        for kind in enabled:
            cupti.activity_disable(kind)
        flush(1)

        def seq_kernels():              # raw buffers are not parsed here: no kernel count
            return None if raw else got["kernel"] - base["kernel"]
        out["seq_kernels_sync"] = seq_kernels()
        time.sleep(0.5)
        out["seq_kernels_0.5s"] = seq_kernels()
    out["after"] = bench()
    time.sleep(2.0)
    out["after_2s"] = bench()
    if got is not None:
        out["records"] = got
    return out


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        print("RESULT " + json.dumps(child(json.loads(sys.argv[2]))), flush=True)
        return
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated, run in this order")
    ap.add_argument("--repeat", type=int, default=1, help="rounds over the configs (interleaved)")
    args = ap.parse_args()
    res = {}
    runs = [(f"{n}#{r + 1}" if args.repeat > 1 else n, CONFIGS[n])
            for r in range(args.repeat) for n in args.configs.split(",")]
    for name, kinds in runs:
        p = subprocess.run([sys.executable, __file__, "--child", json.dumps(kinds)], capture_output=True,
                           text=True, timeout=120)
        line = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
        res[name] = json.loads(line[0][7:]) if line else {"error": p.stderr[-800:]}
        r = res[name]
        if "before" in r:
            r["during_x"] = round(r["during"] / r["before"], 3)
            r["after_x"] = round(r["after"] / r["before"], 3)
            r["after_2s_x"] = round(r["after_2s"] / r["before"], 3)
        print(name, json.dumps(r), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)


if __name__ == "__main__":
    main()
