"""An eager model replayed as a manual ``torch.cuda.graph`` (issue 27, tests/gpu/captured.py).

    python tests/targets/graph_replay.py [--capture-now]

Warms the model up (eager, on a side stream), captures a graph at once with ``--capture-now``,
prints ``ready``; then reads commands on stdin (a select loop: Python runs between them, so an
agent can be injected while it waits): ``capture`` (capture the graph now, prints ``done``),
``replay N`` (N replays, synchronized, ``done``), ``quit``. Lines of the model that launch
kernels end in ``# MODEL_LINE``.
"""

import argparse

import torch
from stdin_commands import commands


class Block(torch.nn.Module):
    def __init__(self, d=1024):
        super().__init__()
        self.ln = torch.nn.LayerNorm(d)
        self.up = torch.nn.Linear(d, 4 * d)
        self.down = torch.nn.Linear(4 * d, d)

    def forward(self, x):
        h = self.up(self.ln(x))                                   # MODEL_LINE
        h = torch.nn.functional.gelu(h)                           # MODEL_LINE
        return x + self.down(h)                                   # MODEL_LINE


class Model(torch.nn.Module):
    def __init__(self, n=4):
        super().__init__()
        self.blocks = torch.nn.ModuleList(Block() for _ in range(n))

    def forward(self, x):
        for b in self.blocks:
            x = b(x)                                              # MODEL_LINE
        return x.softmax(-1)                                      # MODEL_LINE




def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--capture-now", action="store_true")
    a = ap.parse_args()
    torch.manual_seed(0)
    model = Model().cuda().eval()
    x = torch.randn(64, 256, 1024, device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s), torch.no_grad():
        for _ in range(3):
            model(x)
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    graph = None

    def capture():
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g), torch.no_grad():
            model(x)
        torch.cuda.synchronize()
        return g

    if a.capture_now:
        graph = capture()
    print("ready", flush=True)
    for line in commands():
        cmd = line.split()
        if not cmd or cmd[0] == "quit":
            break
        if cmd[0] == "capture":
            graph = capture()
        elif cmd[0] == "replay":
            for _ in range(int(cmd[1])):
                graph.replay()
            torch.cuda.synchronize()
        print("done", flush=True)


if __name__ == "__main__":
    main()
