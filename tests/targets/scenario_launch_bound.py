"""Scenario launch_bound (GPU): tiny matmuls launched one by one from a Python loop.

Problem: 256 separate 128x128 matmuls per step: each kernel runs for a few µs, less than its
launch costs on the CPU, so the GPU idles between them. Fix: one batched `torch.bmm` over the stack.
"""

import torch

from scenario_recorder import main


def make(fixed: bool):
    device = "cuda" if torch.cuda.is_available() else "cpu"
    a = torch.randn(256, 128, 128, device=device)
    b = torch.randn(256, 128, 128, device=device)
    out = torch.empty(256, 128, 128, device=device)

    def step():
        if fixed:
            torch.bmm(a, b, out=out)
        else:
            for i in range(a.shape[0]):
                torch.mm(a[i], b[i], out=out[i])
        return out

    return step


if __name__ == "__main__":
    main("launch_bound", make)
