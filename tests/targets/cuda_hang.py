"""Target (CUDA): a job stuck in torch.cuda.synchronize() behind a long kernel.

Prints `ready`, then on each stdin line (tests/targets/stdin_commands.py): launches a spin kernel
of about CYCLES GPU cycles (torch.cuda._sleep; argv[1], default 2e10: ~10 s on an H200) on the
line marked LAUNCH and waits for it on the line marked WAIT, then prints `done`.
"""

import sys

import torch

from stdin_commands import commands

CYCLES = int(float(sys.argv[1])) if len(sys.argv) > 1 else int(2e10)


def step() -> None:
    torch.cuda._sleep(CYCLES)  # LAUNCH
    torch.cuda.synchronize()  # WAIT


torch.zeros(1, device="cuda")   # the context, before the attach; the spin kernel's module is not loaded yet
print("ready", flush=True)
for _ in commands():
    step()
    print("done", flush=True)
