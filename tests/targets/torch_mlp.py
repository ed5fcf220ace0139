"""Target: a tiny torch CPU MLP training loop (forward, backward, optimizer step).

argv: [STEPS] [--bench]. Prints `ready`, waits for a line, runs STEPS steps, prints
`done SECONDS`; repeats on every further line (so a benchmark can time before/during/after
attach in one process); an empty line or EOF exits. Small tensors: ops cost ~2 µs, so the
loop is dominated by per-op overhead (worst case for op probes).
"""

import sys
import time

import torch

torch.manual_seed(0)
torch.set_num_threads(1)
steps = int(sys.argv[1]) if len(sys.argv) > 1 else 20
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x = torch.randn(4, 8)
y = torch.randn(4, 4)


def train_step():
    opt.zero_grad(set_to_none=True)
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()


for _ in range(20):  # warm up allocator and dispatch caches
    train_step()
print("ready", flush=True)
while True:
    line = sys.stdin.readline()
    if not line.strip():
        break
    n = int(line.split()[1]) if len(line.split()) > 1 else steps
    t0 = time.perf_counter()
    for _ in range(n):
        train_step()
    print(f"done {time.perf_counter() - t0:.6f}", flush=True)
