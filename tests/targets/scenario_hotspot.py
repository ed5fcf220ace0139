"""Scenario hotspots: a loop-invariant inverse recomputed on every step.

Problem: `torch.linalg.inv(cov)` of a constant 512x512 matrix inside the step dominates it. Fix:
compute it once before the loop (what the hotspot finding points at).
"""

import torch

from scenario_recorder import main


def make(fixed: bool):
    device = "cuda" if torch.cuda.is_available() else "cpu"
    a = torch.randn(512, 512, device=device)
    cov = a @ a.t() + 512 * torch.eye(512, device=device)
    x = torch.randn(256, 512, device=device)
    precision = torch.linalg.inv(cov) if fixed else None

    def step():
        p = precision if fixed else torch.linalg.inv(cov)
        d = (x @ p * x).sum(dim=1)
        return torch.exp(-0.5 * d).mean()

    return step


if __name__ == "__main__":
    main("hotspot", make)
