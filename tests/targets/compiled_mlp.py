"""A torch.compile'd (Inductor, CPU) MLP training step: compiles, prints `ready`, then steps until
SIGTERM and prints `steps=N`. Set TORCHINDUCTOR_CACHE_DIR to a fresh directory: a warm FX graph
cache hands back the stack traces of the run that filled it. One thread (`torch.set_num_threads`).

`compiled_mlp.py --dump OUT.json` compiles, writes the agent's `inductor` messages for its modules
(inject/agent/inductor.py) with the repository root written as /src and the cache directory as
/tmp/torchinductor, and exits: how tests/data/inductor/compiled_mlp_cpu.json was recorded."""

import json
import os
import signal
import sys

import torch

torch.set_num_threads(1)


class MLP(torch.nn.Module):
    def __init__(self, d=256):
        super().__init__()
        self.up = torch.nn.Linear(d, 4 * d)
        self.down = torch.nn.Linear(4 * d, d)

    def forward(self, x):
        h = torch.relu(self.up(x))                      # MODEL_LINE up
        h = h * torch.sigmoid(h)                        # MODEL_LINE gate
        return (self.down(h) + x).pow(2).mean()         # MODEL_LINE down


def main():
    model = MLP()
    step = torch.compile(model)
    x = torch.randn(256, 256)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    for _ in range(3):                                  # compile forward and backward
        step(x).backward()
    if len(sys.argv) == 3 and sys.argv[1] == "--dump":
        dump(sys.argv[2])
        return
    stop = []
    signal.signal(signal.SIGTERM, lambda *a: stop.append(1))
    print("ready", flush=True)
    n = 0
    while not stop:
        opt.zero_grad(set_to_none=False)
        step(x).backward()
        opt.step()
        n += 1
    print(f"steps={n}", flush=True)
    sys.exit(0)


def dump(out):
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", ".."))
    from stacklens.inject.agent.inductor import InductorWatcher

    msgs = []
    InductorWatcher(lambda m: msgs.append(m) or True, lambda level, text: None).poll()
    text = json.dumps(msgs, indent=0)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    text = text.replace(root, "/src").replace(os.environ.get("TORCHINDUCTOR_CACHE_DIR", "\0"), "/tmp/torchinductor")
    with open(out, "w") as fh:
        fh.write(text)


if __name__ == "__main__":
    main()
