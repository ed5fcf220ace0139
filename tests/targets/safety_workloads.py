"""Workloads of the agent's safety matrix (benchmarks/gpu/safety_matrix.py; CPU: tests/bpf/test_agent_cycles.py).

    python safety_workloads.py WORKLOAD --device cuda|cpu --log FILE [--steps K]

Each workload repeats *episodes* that start from the same state (same weights, same data), so
every episode of one shape must give the same outputs: in this process (against its first episode
of that shape) and in a never-profiled process of the same workload (the matrix compares them).
One JSON line per episode goes to FILE: ``{"ep", "shape", "start", "dur", "out": [floats]}``
(``start``: CLOCK_MONOTONIC, shared by all processes of the machine). The process prints
``warming`` once its model exists (compilation follows), ``ready`` after its first episode, then
runs until SIGTERM (exit 0). ``--switch-file F``: when the number written in F grows, the next
episode uses the next shape, i.e. a new CUDA graph is captured, a new cudagraph-tree recorded, or
a new XLA executable compiled; its first episode logs ``"new": true``. (A file, read once per
episode: SIGUSR1 never reached the loop of a reduce-overhead job on the H200.) Any exception: its
traceback on stderr, exit 1.

Workloads: eager_train, decode (batch-1 greedy decoding), compile_default, compile_ro
(torch.compile mode="reduce-overhead"), cuda_graph (manual torch.cuda.graph capture + replay,
checked against eager in process), dataloader (DataLoader workers, the loader re-created each
episode), two_threads (two threads launching on their own streams), jax (jitted training step; the
XLA flags are the caller's: default flags replay command buffers).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time

WORKLOADS = ("eager_train", "decode", "compile_default", "compile_ro", "cuda_graph", "dataloader",
             "two_threads", "jax")
SHAPES = {"eager_train": (64, 96, 48), "decode": (8, 12, 6), "compile_default": (8, 4, 6),
          "compile_ro": (8, 4, 6), "cuda_graph": (256, 128, 512), "dataloader": (32, 48, 16),
          "two_threads": (64, 32, 128), "jax": (64, 32, 48)}

_stop = threading.Event()


def _switches(path):
    """The number written in the switch file (0 when there is none)."""
    try:
        with open(path) as fh:
            return int(fh.read().strip() or 0)
    except (OSError, ValueError):
        return 0


def _torch_model(torch, width, blocks, attention):
    nn = torch.nn

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1 = nn.LayerNorm(width)
            self.attn = nn.MultiheadAttention(width, 8, batch_first=True) if attention else None
            self.ln2 = nn.LayerNorm(width)
            self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

        def forward(self, x):
            if self.attn is not None:
                h = self.ln1(x)
                x = x + self.attn(h, h, h, need_weights=False)[0]
            return x + self.mlp(self.ln2(x))

    return nn.Sequential(*[Block() for _ in range(blocks)])


class TorchTrain:
    """An episode: weights and optimizer reset, K AdamW steps on fixed data; out: losses + a
    weight checksum."""

    def __init__(self, torch, dev, kind, steps):
        self.torch, self.dev, self.steps = torch, dev, steps
        attention = kind.startswith("compile")
        width = 256 if attention else 512
        self.seq = 64 if attention else None
        blocks = 4 if attention else 2
        if dev == "cpu":                 # CI: a model Inductor's C++ backend compiles in seconds
            width, self.seq, blocks, attention = 32, (8 if attention else None), 1, False
        torch.manual_seed(0)
        self.model = _torch_model(torch, width, blocks, attention).to(dev)
        self.init = [p.detach().clone() for p in self.model.parameters()]
        self.width = width
        self.fn = self.model
        if kind == "compile_default":
            self.fn = torch.compile(self.model)
        elif kind == "compile_ro":
            self.fn = torch.compile(self.model, mode="reduce-overhead")

    def data(self, batch):
        g = self.torch.Generator().manual_seed(batch)
        shape = (batch, self.seq, self.width) if self.seq else (batch, self.width)
        return self.torch.randn(*shape, generator=g).to(self.dev)

    def episode(self, batch, batches=None):
        torch = self.torch
        with torch.no_grad():
            for p, p0 in zip(self.model.parameters(), self.init):
                p.copy_(p0)
        opt = torch.optim.AdamW(self.model.parameters(), lr=1e-3)
        losses = []
        for x in batches if batches is not None else [self.data(batch)] * self.steps:
            if self.fn is not self.model and hasattr(torch, "compiler"):
                torch.compiler.cudagraph_mark_step_begin()
            loss = self.fn(x).float().pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.detach())
        with torch.no_grad():
            check = sum(p.double().sum() for p in self.model.parameters())
        return [float(v) for v in losses] + [float(check)]


class DataLoaderTrain(TorchTrain):
    def __init__(self, torch, dev, steps):
        super().__init__(torch, dev, "dataloader", steps)
        self.sets = {}

    def episode(self, batch, batches=None):
        torch = self.torch
        from torch.utils.data import DataLoader, TensorDataset
        if batch not in self.sets:
            g = torch.Generator().manual_seed(batch)
            self.sets[batch] = TensorDataset(torch.randn(batch * self.steps, self.width, generator=g))
        loader = DataLoader(self.sets[batch], batch_size=batch, shuffle=False, num_workers=2)
        return super().episode(batch, [x.to(self.dev) for (x,) in loader])


class Decode:
    """Batch-1 greedy decoding of 24 tokens from a fixed prompt (a GPT-2-shaped model with random
    weights: transformers' GPT2LMHeadModel where installed); out: the tokens."""

    def __init__(self, torch, dev, steps):
        self.torch, self.dev = torch, dev
        torch.manual_seed(0)
        try:
            from transformers import GPT2Config, GPT2LMHeadModel
            cfg = GPT2Config(n_layer=4, n_embd=512, n_head=8, vocab_size=8192, n_positions=256)
            self.model = GPT2LMHeadModel(cfg).to(dev).eval()
            self.hf = True
        except ImportError:
            self.model = _torch_model(torch, 512, 4, True).to(dev).eval()
            self.emb = torch.nn.Embedding(8192, 512).to(dev)
            self.head = torch.nn.Linear(512, 8192).to(dev)
            self.hf = False

    def episode(self, prompt_len, batches=None):
        torch = self.torch
        ids = (torch.arange(prompt_len, device=self.dev) * 7 % 8192).unsqueeze(0)
        out = []
        with torch.no_grad():
            past = None
            for _ in range(24):
                if self.hf:
                    r = self.model(ids if past is None else ids[:, -1:], past_key_values=past, use_cache=True)
                    past, logits = r.past_key_values, r.logits[:, -1]
                else:
                    logits = self.head(self.model(self.emb(ids)))[:, -1]
                nxt = logits.argmax(-1, keepdim=True)
                ids = torch.cat([ids, nxt], dim=1)
                out.append(float(nxt.item()))
        return out


class ManualGraph:
    """An MLP captured with torch.cuda.graph, replayed on fixed inputs; each replay's output must
    equal the same MLP run eagerly (checked here, in process, for every episode)."""

    def __init__(self, torch, dev, steps):
        self.torch, self.steps = torch, steps
        torch.manual_seed(0)
        nn = torch.nn
        self.mlp = nn.Sequential(nn.Linear(1024, 4096), nn.GELU(), nn.Linear(4096, 1024)).to(dev).eval()
        self.graphs = {}

    def _capture(self, batch):
        torch = self.torch
        g = torch.Generator().manual_seed(batch)
        x = torch.randn(batch, 1024, generator=g).cuda()
        static_in = x.clone()
        with torch.no_grad():
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                for _ in range(3):
                    self.mlp(static_in)
            torch.cuda.current_stream().wait_stream(s)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                static_out = self.mlp(static_in)
            eager = self.mlp(x).clone()
        self.graphs[batch] = (graph, static_in, static_out, x, eager)

    def episode(self, batch, batches=None):
        torch = self.torch
        if batch not in self.graphs:
            self._capture(batch)
        graph, static_in, static_out, x, eager = self.graphs[batch]
        sums = []
        for i in range(self.steps):
            static_in.copy_(x)
            graph.replay()
            if i == self.steps - 1:
                torch.cuda.synchronize()
                if not torch.allclose(static_out, eager, rtol=1e-4, atol=1e-5):
                    raise AssertionError(f"graph replay differs from eager: max abs diff "
                                         f"{(static_out - eager).abs().max().item():.3g}")
        sums.append(float(static_out.double().sum()))
        return sums


class TwoThreads:
    """Two threads, each on its own stream, run an MLP forward K times; out: both results."""

    def __init__(self, torch, dev, steps):
        self.torch, self.dev, self.steps = torch, dev, steps
        torch.manual_seed(0)
        nn = torch.nn
        self.mlps = [nn.Sequential(nn.Linear(512, 2048), nn.GELU(), nn.Linear(2048, 512)).to(dev).eval()
                     for _ in range(2)]
        self.streams = [torch.cuda.Stream() if dev == "cuda" else None for _ in range(2)]

    def episode(self, batch, batches=None):
        torch = self.torch
        res, errors = [None, None], []

        def run(i):
            try:
                g = torch.Generator().manual_seed(batch + i)
                x = torch.randn(batch, 512, generator=g).to(self.dev)
                ctx = torch.cuda.stream(self.streams[i]) if self.streams[i] is not None else _Null()
                with torch.no_grad(), ctx:
                    for _ in range(self.steps):
                        y = self.mlps[i](x)
                    res[i] = float(y.double().sum())
            except BaseException as e:     # surfaced on the main thread
                errors.append(e)

        threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        return res


class _Null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


class JaxTrain:
    """jax.grad of a 4-layer MLP (width 1024) and a small head, a tree_map SGD update, K steps
    per episode from the same initial parameters; out: losses + a parameter checksum."""

    def __init__(self, steps, device):
        import jax
        import jax.numpy as jnp
        self.jax, self.jnp, self.steps = jax, jnp, steps
        key = jax.random.PRNGKey(0)
        dims = [512, 1024, 1024, 1024, 1024]
        params = []
        for a, b in zip(dims, dims[1:]):
            key, k = jax.random.split(key)
            params.append((jax.random.normal(k, (a, b)) / a ** 0.5, jnp.zeros(b)))
        key, k = jax.random.split(key)
        self.init = {"layers": params, "head": jax.random.normal(k, (1024, 16)) / 32.0}

        def loss_fn(p, x, y):
            h = x
            for w, b in p["layers"]:
                h = jax.nn.gelu(h @ w + b)
            return jnp.mean((h @ p["head"] - y) ** 2)

        @jax.jit
        def step(p, x, y):
            loss, g = jax.value_and_grad(loss_fn)(p, x, y)
            return jax.tree_util.tree_map(lambda a, b: a - 1e-2 * b, p, g), loss

        self.step = step

    def episode(self, batch, batches=None):
        jax, jnp = self.jax, self.jnp
        k = jax.random.PRNGKey(batch)
        x = jax.random.normal(k, (batch, 512))
        y = jax.random.normal(jax.random.fold_in(k, 1), (batch, 16))
        p, losses = self.init, []
        for _ in range(self.steps):
            p, loss = self.step(p, x, y)
            losses.append(loss)
        check = sum(float(jnp.sum(w)) for w, _ in p["layers"]) + float(jnp.sum(p["head"]))
        return [float(v) for v in losses] + [check]


def build(workload, device, steps):
    if workload == "jax":
        return JaxTrain(steps, device)
    import torch
    if workload in ("eager_train", "compile_default", "compile_ro"):
        return TorchTrain(torch, device, workload, steps)
    return {"decode": Decode, "cuda_graph": ManualGraph, "dataloader": DataLoaderTrain,
            "two_threads": TwoThreads}[workload](torch, device, steps)


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("workload", choices=WORKLOADS)
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--log", required=True)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--pause-s", type=float, default=0.0, help="sleep between episodes")
    ap.add_argument("--switch-file", default=None)
    a = ap.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: _stop.set())
    import faulthandler                 # SIGUSR2: every thread's stack on stderr (a hang's evidence)
    faulthandler.register(signal.SIGUSR2, all_threads=True)
    if a.workload == "jax" and a.device == "cpu":
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    w = build(a.workload, a.device, a.steps)
    print("warming", flush=True)
    shapes = SHAPES[a.workload]
    shape_i, seen, ep, switched = 0, set(), 0, 0
    with open(a.log, "a", buffering=1) as log:
        while not _stop.is_set():
            n = _switches(a.switch_file) if a.switch_file else 0
            if n > switched:
                switched = n
                shape_i = (shape_i + 1) % len(shapes)
            shape = shapes[shape_i]
            t0 = time.monotonic()
            out = w.episode(shape)
            if a.device == "cuda" and a.workload != "jax":
                sys.modules["torch"].cuda.synchronize()
            dur = time.monotonic() - t0
            log.write(json.dumps({"ep": ep, "shape": shape, "start": t0, "dur": dur, "out": out,
                                  "new": shape not in seen}) + "\n")
            if ep == 0:
                print("ready", flush=True)
            seen.add(shape)
            ep += 1
            if a.pause_s:
                _stop.wait(a.pause_s)
    return 0


if __name__ == "__main__":
    sys.exit(main())
