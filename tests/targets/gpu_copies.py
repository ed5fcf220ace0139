"""Copy and memset target for tests/gpu/copies.py (issue 23 acceptance 3: memcpy/memset GPU time per
path against torch.profiler's).

    python gpu_copies.py [--warmup N] [--mib M]

Functions, each one kind of GPU copy or memset from its own Python line:
  cp_h2d_pageable   D.copy_(pageable host tensor)          → Memcpy HtoD (Pageable -> Device)
  cp_h2d_pinned     D.copy_(pinned, non_blocking=True)     → Memcpy HtoD (Pinned -> Device)
  cp_d2h            pageable host tensor.copy_(D) (.cpu()) → Memcpy DtoH (Device -> Pageable)
  cp_d2h_pinned     pinned.copy_(D, non_blocking=True)     → Memcpy DtoH (Device -> Pinned)
  cp_d2d            D2.copy_(D)                            → Memcpy DtoD or a copy kernel (torch decides)
  ms_memset         cudaMemsetAsync on D through the process's libcudart (ctypes) → Memset (Device)
One step = each function once, then the device synchronized. Prints `ready {json}`, then answers:
  go K            exactly K steps → {"cmd":"go","steps":K,...}
  prof K FN       K calls of FN alone under torch.profiler (CPU+CUDA), after a warm-up step whose
                  records are dropped: the trace's gpu_memcpy / gpu_memset / kernel events summed
                  per name → {"cmd":"prof","fn":FN,"events":{name:{"cat":c,"count":n,"dur_ns":d}}}
  prof_go K       K steps (the work `go` does) under torch.profiler, likewise →
                  {"cmd":"prof_go","steps":K,"events":{...}}: the same GPU work the window saw (a
                  copy's time depends on its neighbours: caches, copy engines, idle gaps)
  quit
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import sys
import tempfile
import time

import torch

from gpu_control import stdin_lines

p = argparse.ArgumentParser()
p.add_argument("--warmup", type=int, default=10)
p.add_argument("--mib", type=int, default=8, help="bytes of each copy, MiB")
args = p.parse_args()

DEV = torch.device("cuda")
N = args.mib * (1 << 20) // 4
D = torch.ones(N, device=DEV)
D2 = torch.empty(N, device=DEV)
H_PAGEABLE = torch.ones(N)
H_PINNED = torch.ones(N).pin_memory()
H_OUT = torch.empty(N)
H_OUT_PINNED = torch.empty(N).pin_memory()


def _cudart():
    """The libcudart torch loaded (so the memset goes through the same runtime as torch's copies)."""
    with open("/proc/self/maps") as fh:
        paths = {line.split()[-1] for line in fh if "libcudart.so" in line}
    for path in sorted(paths):
        lib = ctypes.CDLL(path)
        lib.cudaMemsetAsync.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t, ctypes.c_void_p]
        lib.cudaMemsetAsync.restype = ctypes.c_int
        return lib, path
    return None, None


CUDART, CUDART_PATH = _cudart()


def cp_h2d_pageable() -> None:
    D.copy_(H_PAGEABLE)  # @h2d-pageable


def cp_h2d_pinned() -> None:
    D.copy_(H_PINNED, non_blocking=True)  # @h2d-pinned


def cp_d2h() -> None:
    H_OUT.copy_(D)  # @d2h


def cp_d2h_pinned() -> None:
    H_OUT_PINNED.copy_(D, non_blocking=True)  # @d2h-pinned


def cp_d2d() -> None:
    D2.copy_(D)  # @d2d


def ms_memset() -> None:
    rc = CUDART.cudaMemsetAsync(D2.data_ptr(), 0, D2.numel() * 4, torch.cuda.current_stream().cuda_stream)  # @memset
    if rc:
        raise RuntimeError(f"cudaMemsetAsync returned {rc}")


FUNCS = {f.__name__: f for f in (cp_h2d_pageable, cp_h2d_pinned, cp_d2h, cp_d2h_pinned, cp_d2d, ms_memset)
         if f is not ms_memset or CUDART is not None}


def step() -> None:
    for f in FUNCS.values():
        f()
    torch.cuda.synchronize()


def events_of_trace(path: str) -> dict[str, dict]:
    with open(path) as fh:
        trace = json.load(fh)
    out: dict[str, dict] = {}
    for ev in trace.get("traceEvents", []):
        cat = ev.get("cat")
        if ev.get("ph") == "X" and cat in ("gpu_memcpy", "gpu_memset", "kernel"):
            e = out.setdefault(ev["name"], {"cat": cat, "count": 0, "dur_ns": 0})
            e["count"] += 1
            e["dur_ns"] += int(round(float(ev.get("dur", 0)) * 1000))
    return out


def profiled(k: int, body) -> dict[str, dict]:
    """k calls of body under torch.profiler, after one warm-up call whose records are dropped."""
    from torch.profiler import ProfilerActivity, profile, schedule

    sched = schedule(wait=0, warmup=1, active=1, repeat=1)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], schedule=sched) as prof:
        body()
        prof.step()
        for _ in range(k):
            body()
        prof.step()
    fd, path = tempfile.mkstemp(prefix="stacklens-copies-", suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        return events_of_trace(path)
    finally:
        os.unlink(path)


def main() -> int:
    for _ in range(args.warmup):
        step()
    print("ready " + json.dumps({"pid": os.getpid(), "torch": torch.__version__, "bytes": N * 4,
                                 "funcs": list(FUNCS), "cudart": CUDART_PATH,
                                 "gpu": torch.cuda.get_device_name(0)}), flush=True)
    for line in stdin_lines():
        parts = line.split()
        if not parts:
            continue
        try:
            if parts[0] == "quit":
                break
            if parts[0] == "go":
                k = int(parts[1])
                t = time.perf_counter()
                for _ in range(k):
                    step()
                print(json.dumps({"cmd": "go", "steps": k, "wall_s": time.perf_counter() - t,
                                  "calls": {name: k for name in FUNCS}}), flush=True)
            elif parts[0] == "prof":
                k, fn = int(parts[1]), FUNCS[parts[2]]

                def alone(fn=fn):
                    fn()
                    torch.cuda.synchronize()
                evs = profiled(k, alone)
                print(json.dumps({"cmd": "prof", "fn": parts[2], "calls": k, "events": evs}), flush=True)
            elif parts[0] == "prof_go":
                k = int(parts[1])
                print(json.dumps({"cmd": "prof_go", "steps": k, "events": profiled(k, step)}), flush=True)
            else:
                print(json.dumps({"cmd": parts[0], "error": f"unknown command {parts[0]!r}"}), flush=True)
        except Exception as e:  # noqa: BLE001
            print(json.dumps({"cmd": parts[0], "error": f"{type(e).__name__}: {e}"}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
