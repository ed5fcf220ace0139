"""Ground-truth target for tests/gpu/test_attribution.py: two functions, disjoint kernel sets.

    python gpu_ground_truth.py [--warmup N] [--cpu-smoke] [--threads]

`gt_matmul_f` launches only GEMMs (torch.mm → aten::mm → cuBLAS); `gt_conv_g` launches only
convolutions (F.conv2d → aten::convolution → cuDNN). One step = f() then g(), device synchronized.
`gt_spin` (elementwise mul_, disjoint from both) runs ~0.2 s before every measured run so the GPU
clocks are up; its kernels are left out of the truth and set aside by the test.
With --threads, a step runs f and g at the same time on two long-lived threads (released together
by a barrier), so their launches interleave: the joins must tell the two threads' kernels apart.
Prints `ready {json}` after warm-up, then idles (polling stdin, launching nothing) between commands:
  go K            gt_spin, then exactly K steps, then idle again        → {"cmd":"go","steps":K,...}
  prof K f|g      K calls of that function alone under torch.profiler (CPU+CUDA): a warm-up step
                  (gt_spin; records dropped), then one active step of the K calls; the exported
                  chrome trace's kernel events summed per kernel name
                  → {"cmd":"prof","fn":"f","kernels":{name:{"count":c,"dur_ns":d}},"total_ns":…}
  quit
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import torch
import torch.nn.functional as F

from gpu_control import stdin_lines

p = argparse.ArgumentParser()
p.add_argument("--warmup", type=int, default=20)
p.add_argument("--cpu-smoke", action="store_true")
p.add_argument("--threads", action="store_true", help="f and g concurrently on two threads per step")
args = p.parse_args()

CUDA = torch.cuda.is_available() and not args.cpu_smoke
DEV = torch.device("cuda" if CUDA else "cpu")
torch.backends.cudnn.benchmark = False  # the same conv algorithm every call
torch.backends.cudnn.deterministic = True
torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False
torch.manual_seed(0)

N = 64 if args.cpu_smoke else 2048
A = torch.randn(N, N, device=DEV)
B = torch.randn(N, N, device=DEV)
C = torch.empty(0, device=DEV)
X = torch.randn(2 if args.cpu_smoke else 32, 64, 28 if args.cpu_smoke else 56,
                28 if args.cpu_smoke else 56, device=DEV)
W = torch.randn(64, 64, 3, 3, device=DEV)
Y = torch.empty(0, device=DEV)
S = torch.ones(2**27 if CUDA else 1024, device=DEV)  # 512 MiB on the GPU: ~0.2 ms per pass
SPIN_PASSES = 1000 if CUDA else 2
MM_PER_F = 4
CONV_PER_G = 2


def sync() -> None:
    if CUDA:
        torch.cuda.synchronize()


def gt_matmul_f() -> None:
    global C
    for _ in range(MM_PER_F):
        C = torch.mm(A, B)  # @f-launch


def gt_conv_g() -> None:
    global Y
    for _ in range(CONV_PER_G):
        Y = F.conv2d(X, W, padding=1)  # @g-launch


def gt_spin() -> None:
    """~0.2 s of elementwise kernels (disjoint from f and g) so the GPU clocks are up before a
    measured run; the attribution test leaves its kernels aside."""
    for _ in range(SPIN_PASSES):
        S.mul_(1.0)
    sync()


def step() -> None:
    if THREADS is not None:
        THREADS.step()
        return
    gt_matmul_f()
    gt_conv_g()
    sync()


class TwoThreads:
    """f and g on two long-lived threads; a step releases both at once and waits for both."""

    def __init__(self) -> None:
        import threading

        self.go = threading.Barrier(3)
        self.done = threading.Barrier(3)
        for fn in (gt_matmul_f, gt_conv_g):
            threading.Thread(target=self._worker, args=(fn,), name=f"gt-{fn.__name__}", daemon=True).start()

    def _worker(self, fn) -> None:
        while True:
            self.go.wait()
            fn()
            self.done.wait()

    def step(self) -> None:
        self.go.wait()
        self.done.wait()
        sync()


THREADS = TwoThreads() if args.threads else None


def kernels_of_trace(path: str) -> dict[str, dict[str, int]]:
    with open(path) as fh:
        trace = json.load(fh)
    out: dict[str, dict[str, int]] = {}
    for ev in trace.get("traceEvents", []):
        if ev.get("ph") == "X" and ev.get("cat") == "kernel":
            k = out.setdefault(ev["name"], {"count": 0, "dur_ns": 0})
            k["count"] += 1
            k["dur_ns"] += int(round(float(ev.get("dur", 0)) * 1000))
    return out


def ops_of_trace(path: str) -> dict[str, int]:
    with open(path) as fh:
        trace = json.load(fh)
    out: dict[str, int] = {}
    for ev in trace.get("traceEvents", []):
        if ev.get("ph") == "X" and ev.get("cat") == "cpu_op":
            out[ev["name"]] = out.get(ev["name"], 0) + 1
    return out


def main() -> int:
    for _ in range(args.warmup):
        step()
    sync()
    print("ready " + json.dumps({"pid": os.getpid(), "device": str(DEV), "torch": torch.__version__,
                                 "mm_per_f": MM_PER_F, "conv_per_g": CONV_PER_G, "n": N,
                                 "threads": bool(args.threads),
                                 "gpu": torch.cuda.get_device_name(0) if CUDA else None}), flush=True)
    for line in stdin_lines():
        parts = line.split()
        if not parts:
            continue
        try:
            if parts[0] == "quit":
                break
            if parts[0] == "go":
                k = int(parts[1])
                gt_spin()
                t = time.perf_counter()
                for _ in range(k):
                    step()
                print(json.dumps({"cmd": "go", "steps": k, "wall_s": time.perf_counter() - t,
                                  "mm_calls": k * MM_PER_F, "conv_calls": k * CONV_PER_G}), flush=True)
            elif parts[0] == "prof":
                from torch.profiler import ProfilerActivity, profile, schedule

                k, which = int(parts[1]), parts[2]
                fn = {"f": gt_matmul_f, "g": gt_conv_g}[which]
                acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if CUDA else [])
                # warm-up step (CUPTI on, records dropped): gt_spin brings the clocks up right
                # before the active step, which holds exactly the K calls
                sched = schedule(wait=0, warmup=1, active=1, repeat=1)
                with profile(activities=acts, schedule=sched) as prof:
                    gt_spin()
                    prof.step()
                    for _ in range(k):
                        fn()
                        sync()
                    prof.step()
                fd, path = tempfile.mkstemp(prefix="stacklens-gt-", suffix=".json")
                os.close(fd)
                try:
                    prof.export_chrome_trace(path)
                    ks = kernels_of_trace(path)
                    ops = ops_of_trace(path)
                finally:
                    os.unlink(path)
                print(json.dumps({"cmd": "prof", "fn": which, "calls": k, "kernels": ks,
                                  "total_ns": sum(v["dur_ns"] for v in ks.values()),
                                  "count": sum(v["count"] for v in ks.values()), "cpu_ops": ops}), flush=True)
            else:
                print(json.dumps({"cmd": parts[0], "error": f"unknown command {parts[0]!r}"}), flush=True)
        except Exception as e:  # noqa: BLE001
            print(json.dumps({"cmd": parts[0], "error": f"{type(e).__name__}: {e}"}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
