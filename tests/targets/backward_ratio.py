"""A CPU training loop with two layers of known cost ratio, for the backward link's tests.

`small` is Linear(D, D), `big` Linear(D, 2D); the input requires grad, so both layers' backward
nodes (AddmmBackward0) compute grad-input and grad-weight GEMMs and `big`'s cost about twice
`small`'s. The ratio on this machine is measured before `ready`: the time inside each layer's
backward node (CPU time of the thread, so preemption on a busy machine does not count), bracketed by
the node's autograd hooks. One thread. Prints `ready`, then answers `info`
on stdin with a JSON line: {"line_small", "line_big", "backward_ratio", "backward_ratio_se"} (the
ratio's mean over blocks of steps and its standard error); trains until killed.
"""

import json
import statistics
import sys
import threading
import time

import torch

torch.set_num_threads(1)
D = 512
B = 128


class TwoLayers(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.small = torch.nn.Linear(D, D)
        self.big = torch.nn.Linear(D, 2 * D)

    def forward(self, x):
        h = self.small(x)  # LINE_SMALL
        return self.big(h)  # LINE_BIG


def line_of(tag: str) -> int:
    with open(__file__) as fh:
        return next(i for i, text in enumerate(fh, 1) if text.rstrip().endswith(tag))


def node_seconds(steps: int = 100) -> tuple[float, float]:
    """Time inside each layer's AddmmBackward0 over `steps` training steps: autograd's pre-hook
    and hook of the node bracket its apply()."""
    spent = {"small": 0.0, "big": 0.0}
    for _ in range(steps):
        h = model.small(x)
        y = model.big(h)
        for name, node in (("small", h.grad_fn), ("big", y.grad_fn)):
            t0 = [0.0]
            node.register_prehook(lambda g, t0=t0: t0.__setitem__(0, time.thread_time()))
            node.register_hook(lambda gi, go, t0=t0, name=name: spent.__setitem__(
                name, spent[name] + time.thread_time() - t0[0]))
        y.sum().backward()
    return spent["small"], spent["big"]


model = TwoLayers()
x = torch.randn(B, D, requires_grad=True)
node_seconds(20)   # warm up
# the ratio over 6 blocks of 60 steps: its mean and standard error (the test's bound takes both
# its own sampling error and this one)
blocks = [big / small for small, big in (node_seconds(60) for _ in range(6))]
ratio = statistics.mean(blocks)
info = {"line_small": line_of("# LINE_SMALL"), "line_big": line_of("# LINE_BIG"), "backward_ratio": ratio,
        "backward_ratio_se": statistics.stdev(blocks) / len(blocks) ** 0.5}


def answer() -> None:
    for line in sys.stdin:
        if line.strip() == "info":
            print(json.dumps(info), flush=True)


threading.Thread(target=answer, daemon=True).start()
print("ready", flush=True)
while True:
    model(x).sum().backward()
