"""Target: a 2-rank DistributedDataParallel training loop on CPU (gloo), one rank slower on purpose.
Run under torchrun (it sets RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT).

Each rank prints `ready RANK PID`, then trains a small MLP forever, printing `step RANK N` every
20 steps. The rank named by SLOW_RANK (env; default none) also runs the line marked SLOW: extra
matrix products each step, so the other ranks wait for it in DDP's gradient all-reduce.
Runs until killed.
"""

import os
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel


def say(line: str) -> None:
    sys.stdout.write(line + "\n")   # one write per line: the ranks share the output
    sys.stdout.flush()


def slow_down(x: torch.Tensor, w: torch.Tensor) -> None:
    for _ in range(6):
        x = x @ w  # SLOW


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    slow = os.environ.get("SLOW_RANK", "") == str(rank)
    torch.manual_seed(0)
    model = DistributedDataParallel(nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 256)))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x, y = torch.randn(64, 256), torch.randn(64, 256)
    # made once: drawn each step, randn was a rival hotspot to the SLOW line inside slow_down
    extra_x, extra_w = torch.randn(64, 384), torch.randn(384, 384)
    say(f"ready {rank} {os.getpid()}")
    step = 0
    while True:
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)  # FORWARD
        if slow:
            slow_down(extra_x, extra_w)
        loss.backward()  # BACKWARD
        opt.step()
        step += 1
        if step % 20 == 0:
            say(f"step {rank} {step}")


if __name__ == "__main__":
    main()
