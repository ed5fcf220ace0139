"""Scenario layout_conversions: a transposed activation made contiguous on every step.

Problem: `x.t().contiguous() @ w` copies a 4096x1024 view of a 1024x4096 fp32 tensor into transposed layout each
step before the matmul. Fix: `x.t() @ w`: the matmul takes the transposed operand as it is.
"""

import torch

from scenario_recorder import main


def make(fixed: bool):
    device = "cuda" if torch.cuda.is_available() else "cpu"
    x = torch.randn(1024, 4096, device=device)
    w = torch.randn(1024, 8, device=device)

    def step():
        if fixed:
            h = x.t() @ w
        else:
            h = x.t().contiguous() @ w
        return torch.relu(h).sum()

    return step


if __name__ == "__main__":
    main("layout", make)
