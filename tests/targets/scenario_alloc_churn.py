"""Scenario allocator_churn: a large buffer allocated afresh on every step.

Problem: a 32M-element (128 MiB) fp32 accumulator is created with `torch.zeros` in the step: the
CPU allocator maps fresh memory each time, the kernel page-faults and zeroes it, and it is
unmapped again when freed (on a GPU the caching allocator hides most of this until shapes vary
or memory runs short). Fix: allocate the buffer once and reset it with `zero_()`.
"""

import torch

from scenario_recorder import main

N = 32 * 1024 * 1024


def make(fixed: bool):
    device = "cuda" if torch.cuda.is_available() else "cpu"
    a = torch.rand(N, device=device)
    buf = torch.empty(N, device=device)

    def step():
        if fixed:
            acc = buf.zero_()
        else:
            acc = torch.zeros(N, device=device)
        acc.add_(a)
        return acc[:1]

    return step


if __name__ == "__main__":
    main("alloc_churn", make)
