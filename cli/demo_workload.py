"""The bundled demo workload: a small PyTorch model trained on random data, forever.

Runs on the GPU when one is present, else on the CPU. `stacklens demo` starts it and attaches by
PID; it has a clear split between data preparation, forward, backward and the optimizer step.
"""

import sys
import time

import torch
from torch import nn


class MLP(nn.Module):
    def __init__(self, width: int = 256) -> None:
        super().__init__()
        self.fc1 = nn.Linear(width, width)
        self.fc2 = nn.Linear(width, width)
        self.head = nn.Linear(width, 10)

    def forward(self, x):
        x = torch.relu(self.fc1(x))
        x = torch.relu(self.fc2(x))
        return self.head(x)


def make_batch(device, n: int = 64, width: int = 256):
    x = torch.randn(n, width, device=device)
    y = torch.randint(0, 10, (n,), device=device)
    return x, y


def train_step(model, opt, loss_fn, x, y):
    opt.zero_grad(set_to_none=True)
    loss = loss_fn(model(x), y)
    loss.backward()
    opt.step()
    return loss


def main() -> None:
    torch.set_num_threads(1)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = MLP().to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    loss_fn = nn.CrossEntropyLoss()
    print(f"ready pid={__import__('os').getpid()} device={device}", flush=True)
    deadline = time.monotonic() + float(sys.argv[1]) if len(sys.argv) > 1 else None
    while deadline is None or time.monotonic() < deadline:
        x, y = make_batch(device)
        train_step(model, opt, loss_fn, x, y)


if __name__ == "__main__":
    main()
