"""Target: a torch CPU training loop fed by a DataLoader (2 worker processes) through a prefetch
thread. argv[1] = stop file. Every epoch retrains from the same seed; prints the first epoch's
loss and how many later epochs differed (must be 0)."""
import os
import queue
import sys
import threading

import torch
from torch.utils.data import DataLoader, TensorDataset


def make_loader():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 16, generator=g)
    y = (x.sum(dim=1, keepdim=True) > 0).float()
    return DataLoader(TensorDataset(x, y), batch_size=32, shuffle=False, num_workers=2,
                      persistent_workers=True)


def epoch(loader):
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    q = queue.Queue(maxsize=4)

    def prefetch():
        for batch in loader:
            q.put(batch)
        q.put(None)

    t = threading.Thread(target=prefetch, name="prefetch")
    t.start()
    loss = None
    while (batch := q.get()) is not None:
        xb, yb = batch
        opt.zero_grad()
        loss = torch.nn.functional.binary_cross_entropy_with_logits(model(xb), yb)
        loss.backward()
        opt.step()
    t.join()
    return loss.item()


def main():
    torch.set_num_threads(1)
    stop = sys.argv[1]
    loader = make_loader()
    first = epoch(loader)
    print("ready", flush=True)
    bad = 0
    while not os.path.exists(stop):
        if epoch(loader) != first:
            bad += 1
    print(f"loss={first:.6f} mismatches={bad}", flush=True)


if __name__ == "__main__":
    main()
