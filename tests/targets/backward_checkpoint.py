"""Reentrant backward (torch.utils.checkpoint, use_reentrant=True), for the backward link's tests.

The checkpointed block's backward runs inside the outer node (a PyNode) on the same thread: it
recomputes the block's forward and runs a nested backward. Prints `ready`, trains until killed.
"""

import torch
from torch.utils.checkpoint import checkpoint

torch.set_num_threads(1)
D = 512
a = torch.nn.Linear(D, D)
b = torch.nn.Linear(D, 2 * D)
x = torch.randn(128, D, requires_grad=True)


def block(h):
    return b(h)  # BLOCK_LINE


print("ready", flush=True)
while True:
    h = a(x)  # OUTER_LINE
    y = checkpoint(block, h, use_reentrant=True)  # CHECKPOINT_LINE
    y.sum().backward()
