"""Target: a torch CPU training loop whose DataLoader iterator is made anew every epoch.

argv: [NUM_WORKERS (default 2)] [cut]. Prints `ready`, then trains until killed. Each epoch
iterates a fresh DataLoader (num_workers worker processes started and joined per epoch, no
persistent workers) and compiles that epoch's augmentation from source, as pipelines that build
transforms or namedtuples at run time do: code objects come and go, and a sample may name a code
object that is freed (its memory reused) before the profiler reads it — the reads that ended
stacklens sessions in issue 26.
`cut`: the hostile variant, for when that race does not come on its own: each epoch's
augmentation gets a location table cut inside an entry (what a freed and reused line table can
look like to a reader), swapped in through ctypes (cut_linetable.py). CPython itself reads it
only for a traceback or a line number, which this function never gives.
"""

import os
import sys

import torch
from torch.utils.data import DataLoader, Dataset

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cut_linetable import cut_table, swap_linetable  # noqa: E402

WORKERS = int(sys.argv[1]) if len(sys.argv) > 1 else 2
CUT = len(sys.argv) > 2 and sys.argv[2] == "cut"
torch.manual_seed(0)
torch.set_num_threads(1)


class Synthetic(Dataset):
    def __len__(self):
        return 64     # 4 batches: an epoch is mostly its workers starting and stopping

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i)
        return torch.randn(32, generator=g), torch.randn(8, generator=g)


# small (pymalloc-sized) code objects with a Python loop, so that CPU samples land in them
AUGMENT = """
def augment_{epoch}(x):
    scale = 1.0
    for i in range(4000):
        scale = scale * 0.9999 + 0.0001 * ((i + {epoch}) % 7)
    return x * scale
"""


def epoch_augment(epoch: int):
    ns: dict = {}
    exec(compile(AUGMENT.format(epoch=epoch), f"<augment {epoch}>", "exec"), ns)
    fn = ns[f"augment_{epoch}"]
    if CUT:
        swap_linetable(fn.__code__, cut_table(fn.__code__.co_linetable))
    return fn


def main() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    data = Synthetic()
    print("ready", flush=True)
    epoch = 0
    while True:
        augment = epoch_augment(epoch)
        for x, y in DataLoader(data, batch_size=16, shuffle=True, num_workers=WORKERS):
            opt.zero_grad(set_to_none=True)
            loss = torch.nn.functional.mse_loss(model(augment(x)), y)
            loss.backward()
            opt.step()
        epoch += 1


if __name__ == "__main__":
    main()
