"""A torch.compile'd (Inductor; `--mode reduce-overhead` for cudagraph trees, default mode
otherwise) training step of four transformer blocks on CUDA, for tests/gpu/compiled.py. Compiles,
prints `ready`, then reads commands on stdin: `steps N` (N steps, synchronized, prints `done`),
`profile N OUT` (N steps under torch.profiler with stacks: per kernel, the generated wrapper line
of the op that launched it, see `kernel_sites`, and every GPU kernel as CUPTI named it with its
correlation id, start and duration, as JSON in OUT, prints `done`), `quit`. Between commands the
main thread runs Python (a select loop), so an agent can be injected while it waits."""

import argparse
import json
import re

import torch
from stdin_commands import commands


class Block(torch.nn.Module):
    def __init__(self, d=1024, heads=16):
        super().__init__()
        self.ln1 = torch.nn.LayerNorm(d)
        self.qkv = torch.nn.Linear(d, 3 * d)
        self.proj = torch.nn.Linear(d, d)
        self.ln2 = torch.nn.LayerNorm(d)
        self.up = torch.nn.Linear(d, 4 * d)
        self.down = torch.nn.Linear(4 * d, d)
        self.heads = heads

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)                          # MODEL_LINE qkv
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        a = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)  # MODEL_LINE attn
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))                      # MODEL_LINE proj
        return x + self.down(torch.nn.functional.gelu(self.up(self.ln2(x))))       # MODEL_LINE mlp


class Model(torch.nn.Module):
    def __init__(self, n=4, d=1024):
        super().__init__()
        self.blocks = torch.nn.ModuleList(Block(d) for _ in range(n))

    def forward(self, x):
        for blk in self.blocks:
            x = blk(x)                                                             # MODEL_LINE block
        return x.float().pow(2).mean()                                             # MODEL_LINE loss


_WRAPPER = re.compile(r"^(.*\.py)\((\d+)\): (?:\w+\.)?call$")


def kernel_sites(prof):
    """[kernel name, wrapper file, wrapper line, GPU ns] per kernel of the profile: the innermost
    ``….py(LINE): call`` frame of the Python stack of the op that launched it (Triton launches
    are ops named after their kernel; extern kernels run under their aten op); "" and 0 when that
    op's stack holds no wrapper frame."""
    out = []
    for e in prof.events():
        for k in getattr(e, "kernels", ()):
            site = next((m for m in (_WRAPPER.match(f.strip()) for f in reversed(e.stack or ())) if m), None)
            out.append([k.name, site.group(1) if site else "", int(site.group(2)) if site else 0,
                        int(k.duration * 1000)])
    return out


def kernel_list(prof):
    """[name, correlation id, start ns, duration ns] of every GPU kernel of the profile (graph
    replays included: their kernels share the graph launch's correlation id)."""
    out = []
    for e in prof.profiler.kineto_results.events():
        if e.device_type() == torch.autograd.DeviceType.CUDA and e.name() and e.duration_ns() > 0:
            out.append([e.name(), e.correlation_id(), e.start_ns(), e.duration_ns()])
    return out




def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", default="default")
    mode = ap.parse_args().mode
    model = Model().cuda()
    step_fn = torch.compile(model) if mode == "default" else torch.compile(model, mode=mode)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(8, 512, 1024, device="cuda")

    def step():
        opt.zero_grad(set_to_none=True)
        step_fn(x).backward()
        opt.step()

    for _ in range(5):
        step()
    torch.cuda.synchronize()
    print("ready", flush=True)
    for line in commands():
        cmd = line.split()
        if not cmd or cmd[0] == "quit":
            break
        n = int(cmd[1])
        if cmd[0] == "steps":
            for _ in range(n):
                step()
            torch.cuda.synchronize()
        elif cmd[0] == "profile":
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                    torch.profiler.ProfilerActivity.CUDA], with_stack=True) as prof:
                for _ in range(n):
                    step()
                torch.cuda.synchronize()
            with open(cmd[2], "w") as fh:
                json.dump({"sites": kernel_sites(prof), "kernels": kernel_list(prof)}, fh)
        print("done", flush=True)


if __name__ == "__main__":
    main()
