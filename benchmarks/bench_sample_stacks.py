"""CPU samples over minutes: how many keep their native stack (root + eBPF; no GPU).

    sudo .venv/bin/python benchmarks/bench_sample_stacks.py [SECONDS] [--hz 99]

Attaches the probes (CPU sampling on, operator probes on) to tests/targets/torch_train.py, a torch
CPU training loop, and prints every 30 s: samples so far, samples without any native stack (the
unwind failed or was refused), samples whose stack was cut but kept, and the BPF stack-error
counter. A stack map holds one stack per bucket and never frees one; nearly every sample is a
new stack (its leaf differs), so samples that went through the map lost their stack more and more
as it filled. Samples now carry their addresses themselves (cpu.bpf.c).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from stacklens.bpf import ProbeConfig, ProbeSession  # noqa: E402
from stacklens.bpf.decode import TRUNCATED  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("seconds", type=float, nargs="?", default=300.0)
    ap.add_argument("--hz", type=int, default=99)
    a = ap.parse_args()
    p = subprocess.Popen([sys.executable, str(ROOT / "tests" / "targets" / "torch_train.py")],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        if p.stdout.readline().strip() != "ready":
            raise SystemExit("target did not start")
        s = ProbeSession(p.pid, ProbeConfig(cpu_sample_hz=a.hz))
        s.attach()
        t0, next_t = time.monotonic(), 30.0
        samples = without = cut = 0
        try:
            while time.monotonic() - t0 < a.seconds:
                for e in s.poll(200):
                    if e.kind != "cpu_sample":
                        continue
                    samples += 1
                    st = e.native_stack
                    if not st or st == (TRUNCATED,):
                        without += 1
                    elif st[0] == TRUNCATED:
                        cut += 1
                if time.monotonic() - t0 >= next_t:
                    print(json.dumps({"t_s": next_t, "samples": samples, "without_native_stack": without,
                                      "cut_but_kept": cut, "stack_errors": s.stats()["stack_errors"]}), flush=True)
                    next_t += 30.0
        finally:
            s.detach()
    finally:
        p.kill()
        p.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
