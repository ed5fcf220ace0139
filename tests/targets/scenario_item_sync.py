"""Scenario sync_stalls: `.item()` per element in the training loop.

Problem: counts confident predictions with a Python loop of `.item()` calls (one device→host
sync each on a GPU; one dispatch + scalar copy each on the CPU). Fix: one tensor expression, accumulated
on the device, read with a single `.item()` every 100 steps.
"""

import torch

from scenario_recorder import main


def make(fixed: bool):
    device = "cuda" if torch.cuda.is_available() else "cpu"
    w = torch.randn(128, 128, device=device) / 8
    x = torch.randn(4096, 128, device=device)
    stats = {"confident": 0, "steps": 0}
    on_device = torch.zeros((), dtype=torch.long, device=device)

    def step():
        probs = torch.softmax(x @ w, dim=1).amax(dim=1)
        if fixed:
            on_device.add_((probs > 0.01).sum())
            stats["steps"] += 1
            if stats["steps"] % 100 == 0:
                stats["confident"] += on_device.item()
        else:
            for i in range(probs.shape[0]):
                if probs[i].item() > 0.01:
                    stats["confident"] += 1

    return step


if __name__ == "__main__":
    main("item_sync", make)
