"""Scenario host_device_copies (GPU): a pageable host batch copied synchronously every step.

Problem: the batch lives in ordinary (pageable) host memory and `.to("cuda")` blocks until the
copy is done. Fix: pin the host buffer once and copy with `non_blocking=True`, so the copy runs
at full bandwidth and overlaps the compute.
"""

import torch

from scenario_recorder import main


def make(fixed: bool):
    device = "cuda" if torch.cuda.is_available() else "cpu"
    host = torch.randn(16, 3, 224, 224)
    if fixed and device == "cuda":
        host = host.pin_memory()
    w = torch.randn(3 * 224 * 224, 64, device=device) / 400

    def step():
        x = host.to(device, non_blocking=fixed)
        return (x.flatten(1) @ w).relu().sum()

    return step


if __name__ == "__main__":
    main("h2d_copies", make)
