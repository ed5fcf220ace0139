"""Target (GPU machine): batch-1 greedy decoding of a GPT-2-shaped causal LM with random weights
(transformers' GPT2LMHeadModel where installed: tests/targets/safety_workloads.py `Decode`), in
episodes of 24 tokens, forever; and, on request, the same episodes under torch.profiler.

    python decode_window.py --cmd FILE --out DIR

Prints `ready` after its first episode. While running it reads FILE once per episode; when FILE
says `profile N` (once), it runs N episodes under torch.profiler (CPU + CUDA, after one warm-up
episode) and writes DIR/torch_profiler.json: {kernel name: [count, summed ns]} and the episode
count, then goes on decoding. SIGTERM ends it (exit 0).
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "targets"))

from safety_workloads import Decode  # noqa: E402

_stop = threading.Event()


def profile(decode: Decode, n: int, out: Path) -> None:
    import torch
    from torch.profiler import ProfilerActivity

    decode.episode(8)
    with torch.profiler.profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            decode.episode(8)   # each ends in .item(): the GPU has finished its kernels
    kernels: dict[str, list[int]] = {}
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA and ev.device_time_total > 0:
            k = kernels.setdefault(ev.name, [0, 0])
            k[0] += 1
            k[1] += int(ev.device_time_total * 1000)
    (out / "torch_profiler.json").write_text(json.dumps({"episodes": n, "kernels": kernels}))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cmd", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="cpu: a dry run of the harness")
    a = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: _stop.set())
    import torch

    decode = Decode(torch, a.device, 4)
    decode.episode(8)
    print("ready", "hf" if decode.hf else "builtin", flush=True)
    done = False
    episodes = 0
    while not _stop.is_set():
        decode.episode(8)
        episodes += 1
        if not done:
            try:
                words = Path(a.cmd).read_text().split()
            except OSError:
                words = []
            if words[:1] == ["profile"]:
                profile(decode, int(words[1]), Path(a.out))
                done = True
                print("profiled", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
