"""Target: a torch CPU training loop fed by a DataLoader (2 worker processes) through a prefetch
thread. argv[1] = stop file. Every epoch retrains from the same seed; prints the first epoch's
loss and how many later epochs differed (must be 0).

argv[2] (optional) = hold file: while it exists the loop waits between two epochs, its quiescent
point, and says so by creating "<hold>.held" (removed before it goes on). Mid-epoch the thread and
fd counts move (the per-epoch prefetch thread; each batch's tensors arrive as shared-memory fds,
over a connection to the worker's resource sharer), so a leak check compares counts there only.
"""
import os
import queue
import sys
import threading
import time

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


def hold_here(hold):
    """Between epochs: no prefetch thread, no batch alive, the workers idle."""
    if hold is None or not os.path.exists(hold):
        return
    held = hold + ".held"
    while os.path.exists(hold):
        if not os.path.exists(held):
            open(held + ".tmp", "w").close()
            os.rename(held + ".tmp", held)       # seen only once its fd is closed
        time.sleep(0.002)
    os.unlink(held)


def main():
    torch.set_num_threads(1)
    stop = sys.argv[1]
    hold = sys.argv[2] if len(sys.argv) > 2 else None
    loader = make_loader()
    first = epoch(loader)
    print("ready", flush=True)
    bad = 0
    while not os.path.exists(stop):
        hold_here(hold)
        if epoch(loader) != first:
            bad += 1
    print(f"loss={first:.6f} mismatches={bad}", flush=True)


if __name__ == "__main__":
    main()
