"""Long-lived GPU workloads for the overhead benchmark (benchmarks/gpu/bench_overhead.py).

    python gpu_workloads.py {resnet50|gpt2|vit|launch|jax} [--cpu-smoke] [--device cuda|cpu]

Prints `ready {json}` once built and warmed up, then reads commands on stdin, one JSON line each:
  run N               N steps; per-step wall times (device synchronized at each step end), RSS
  torchprof N [stack] the same N steps under torch.profiler (CPU+CUDA activities, with_stack if
                      `stack`), exported with export_chrome_trace to a temp file: its size in bytes
  truth N PATH        N steps under torch.profiler (CPU+CUDA, with_stack), every nn.Module call
                      marked by a `module:CLASS` record_function range (hooks, removed after):
                      every CPU event with its parent, sequence number, forward thread, stack,
                      times and kernels, as JSON at PATH (tests/gpu/backward_truth.py's truth)
  rss                 RSS now
  quit
Random weights and data, nothing is downloaded. --cpu-smoke: tiny sizes on the CPU (harness tests).
$STACKLENS_PIN_CPUS (a CPU list, e.g. 4-7): the target pins itself to those CPUs first thing, before
torch or JAX is imported, so start-up, warm-up, the thread pools' sizing and every thread it starts
are on them (the `ready` line reports the affinity as `cpus`).
Model sources: torchvision / transformers / timm when importable, else a built-in equivalent of
the same architecture (reported as `impl` in the ready line).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import traceback


def rss_bytes() -> int:
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def say(obj) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


# ---------------------------------------------------------------------------------------------
# torch workloads: each builder returns (step_fn, impl_name); step_fn runs one step, no sync.


def _resnet50_fallback(num_classes: int):
    import torch.nn as nn

    class Bottleneck(nn.Module):
        def __init__(self, inp, width, stride):
            super().__init__()
            out = width * 4
            self.conv1 = nn.Conv2d(inp, width, 1, bias=False)
            self.bn1 = nn.BatchNorm2d(width)
            self.conv2 = nn.Conv2d(width, width, 3, stride, 1, bias=False)
            self.bn2 = nn.BatchNorm2d(width)
            self.conv3 = nn.Conv2d(width, out, 1, bias=False)
            self.bn3 = nn.BatchNorm2d(out)
            self.relu = nn.ReLU(inplace=True)
            self.down = None
            if stride != 1 or inp != out:
                self.down = nn.Sequential(nn.Conv2d(inp, out, 1, stride, bias=False), nn.BatchNorm2d(out))

        def forward(self, x):
            idt = x if self.down is None else self.down(x)
            y = self.relu(self.bn1(self.conv1(x)))
            y = self.relu(self.bn2(self.conv2(y)))
            y = self.bn3(self.conv3(y))
            return self.relu(y + idt)

    layers = [nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64), nn.ReLU(inplace=True),
              nn.MaxPool2d(3, 2, 1)]
    inp = 64
    for width, blocks, stride in ((64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2)):
        for i in range(blocks):
            layers.append(Bottleneck(inp, width, stride if i == 0 else 1))
            inp = width * 4
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(inp, num_classes)]
    return nn.Sequential(*layers)


def build_resnet50(dev, smoke: bool, batch: int | None = None):
    import torch
    import torch.nn.functional as F

    try:
        import torchvision

        model = torchvision.models.resnet50(weights=None, num_classes=1000)
        impl = f"torchvision {torchvision.__version__} resnet50"
    except Exception as e:  # noqa: BLE001 — fall back to the same architecture built here
        model = _resnet50_fallback(1000)
        impl = f"built-in resnet50 (torchvision unavailable: {type(e).__name__})"
    size = 32 if smoke else 224
    batch = batch or (2 if smoke else 64)
    model = model.to(dev).train()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    x = torch.randn(batch, 3, size, size, device=dev)
    y = torch.randint(0, 1000, (batch,), device=dev)

    def step():
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()

    return step, f"{impl}, batch {batch}, {size}x{size}, SGD"


def build_gpt2(dev, smoke: bool):
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    if smoke:
        n_layer, n_embd, n_head, vocab, seq, batch = 2, 64, 4, 1000, 32, 2
    else:
        n_layer, n_embd, n_head, vocab, seq, batch = 12, 768, 12, 50257, 512, 8
    try:
        from transformers import GPT2Config, GPT2LMHeadModel

        cfg = GPT2Config(n_layer=n_layer, n_embd=n_embd, n_head=n_head, vocab_size=vocab,
                         n_positions=max(seq, 64))
        model = GPT2LMHeadModel(cfg)
        import transformers

        impl = f"transformers {transformers.__version__} GPT2LMHeadModel (random weights)"

        def loss_of(ids):
            return model(input_ids=ids, labels=ids).loss
    except Exception as e:  # noqa: BLE001
        class LM(nn.Module):
            def __init__(self):
                super().__init__()
                self.tok = nn.Embedding(vocab, n_embd)
                self.pos = nn.Embedding(seq, n_embd)
                layer = nn.TransformerEncoderLayer(n_embd, n_head, 4 * n_embd, dropout=0.1,
                                                   activation="gelu", batch_first=True, norm_first=True)
                self.blocks = nn.TransformerEncoder(layer, n_layer)
                self.ln = nn.LayerNorm(n_embd)
                self.head = nn.Linear(n_embd, vocab, bias=False)

            def forward(self, ids):
                t = ids.shape[1]
                h = self.tok(ids) + self.pos(torch.arange(t, device=ids.device))
                mask = nn.Transformer.generate_square_subsequent_mask(t, device=ids.device)
                return self.head(self.ln(self.blocks(h, mask=mask, is_causal=True)))

        model = LM()
        impl = f"built-in GPT-2-sized nn.TransformerEncoder LM (transformers unavailable: {type(e).__name__})"

        def loss_of(ids):
            logits = model(ids)
            return F.cross_entropy(logits[:, :-1].reshape(-1, vocab), ids[:, 1:].reshape(-1))

    model = model.to(dev).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, vocab, (batch, seq), device=dev)

    def step():
        opt.zero_grad(set_to_none=True)
        loss_of(ids).backward()
        opt.step()

    return step, f"{impl}, {n_layer}x{n_embd}, batch {batch}x{seq}, AdamW"


def build_vit(dev, smoke: bool):
    import torch
    import torch.nn as nn

    batch = 2 if smoke else 64
    model = None
    impl = ""
    if not smoke:
        try:
            import timm

            model = timm.create_model("vit_base_patch16_224", pretrained=False)
            impl = f"timm {timm.__version__} vit_base_patch16_224"
        except Exception as e1:  # noqa: BLE001
            try:
                import torchvision

                model = torchvision.models.vit_b_16(weights=None)
                impl = f"torchvision {torchvision.__version__} vit_b_16 (timm: {type(e1).__name__})"
            except Exception:  # noqa: BLE001
                model = None
    size = 32 if smoke else 224
    if model is None:
        patch, dim, depth, heads = (8, 64, 2, 4) if smoke else (16, 768, 12, 12)

        class ViT(nn.Module):
            def __init__(self):
                super().__init__()
                self.patch = nn.Conv2d(3, dim, patch, patch)
                n = (size // patch) ** 2
                self.cls = nn.Parameter(torch.zeros(1, 1, dim))
                self.pos = nn.Parameter(torch.randn(1, n + 1, dim) * 0.02)
                layer = nn.TransformerEncoderLayer(dim, heads, 4 * dim, dropout=0.0, activation="gelu",
                                                   batch_first=True, norm_first=True)
                self.enc = nn.TransformerEncoder(layer, depth)
                self.ln = nn.LayerNorm(dim)
                self.head = nn.Linear(dim, 1000)

            def forward(self, x):
                h = self.patch(x).flatten(2).transpose(1, 2)
                h = torch.cat([self.cls.expand(h.shape[0], -1, -1), h], 1) + self.pos
                return self.head(self.ln(self.enc(h))[:, 0])

        model = ViT()
        impl = impl or "built-in ViT-B/16-shaped encoder" + (" (smoke size)" if smoke else "")
    model = model.to(dev).eval()
    x = torch.randn(batch, 3, size, size, device=dev)
    use_amp = dev.type == "cuda"

    def step():
        with torch.inference_mode(), torch.autocast(dev.type, dtype=torch.bfloat16, enabled=use_amp):
            model(x)

    return step, f"{impl}, inference, batch {batch}, {size}x{size}" + (", bf16 autocast" if use_amp else "")


def build_launch(dev, smoke: bool):
    import torch

    n = 100 if smoke else 1000
    t = torch.zeros(16, device=dev)

    def step():
        for _ in range(n):
            t.add_(1.0)

    return step, f"launch-bound loop: {n} x add_ on a 16-element tensor per step"


TORCH_BUILDERS = {"resnet50": build_resnet50, "gpt2": build_gpt2, "vit": build_vit, "launch": build_launch}


# ---------------------------------------------------------------------------------------------
# JAX: a jitted MLP training step (jax.grad); `run N` only.


def build_jax(smoke: bool):
    import jax
    import jax.numpy as jnp

    dims = (64, 128, 128, 10) if smoke else (1024, 4096, 4096, 4096, 1024)
    batch = 8 if smoke else 512
    key = jax.random.PRNGKey(0)
    params = []
    for a, b in zip(dims[:-1], dims[1:]):
        key, k1 = jax.random.split(key)
        params.append((jax.random.normal(k1, (a, b)) * (1.0 / a) ** 0.5, jnp.zeros((b,))))
    key, kx, ky = jax.random.split(key, 3)
    x = jax.random.normal(kx, (batch, dims[0]))
    y = jax.random.normal(ky, (batch, dims[-1]))

    def loss(ps, x, y):
        h = x
        for w, b in ps[:-1]:
            h = jax.nn.relu(h @ w + b)
        w, b = ps[-1]
        return jnp.mean((h @ w + b - y) ** 2)

    @jax.jit
    def train_step(ps, x, y):
        g = jax.grad(loss)(ps, x, y)
        return [(w - 1e-3 * gw, b - 1e-3 * gb) for (w, b), (gw, gb) in zip(ps, g)]

    state = {"p": params}

    def step():
        state["p"] = train_step(state["p"], x, y)
        jax.block_until_ready(state["p"])

    devs = [str(d) for d in jax.devices()]
    return step, f"jax {jax.__version__} jitted MLP {dims}, batch {batch}, jax.grad + SGD on {devs}"


# ---------------------------------------------------------------------------------------------


def mark_modules() -> list:
    """Forward pre/post hooks on every nn.Module that open and close a `module:CLASS`
    record_function range: torch.profiler's module view without its Python tracer (torch 2.11
    with CUDA records neither Python calls nor stacks there). Returns the hook handles."""
    import torch

    open_ranges: list = []

    def enter(mod, args):
        # the class that defines forward(), as a Python frame names it (BatchNorm2d: _BatchNorm)
        rf = torch.autograd.profiler.record_function(f"module:{type(mod).forward.__qualname__.rsplit('.', 1)[0]}")
        rf.__enter__()
        open_ranges.append(rf)

    def leave(mod, args, out):
        if open_ranges:
            open_ranges.pop().__exit__(None, None, None)

    return [torch.nn.modules.module.register_module_forward_pre_hook(enter),
            torch.nn.modules.module.register_module_forward_hook(leave)]


def profiler_records(events) -> list[dict]:
    """torch.profiler's CPU events as plain records: name, parent (index), sequence number and
    forward thread (autograd's link), the thread, the Python stack, and the kernels each event
    launched ([name, microseconds]) — what tests/gpu/backward_truth.py needs, nothing else."""
    cpu = [e for e in events if str(getattr(e, "device_type", "")).endswith("CPU")]
    index = {id(e): i for i, e in enumerate(cpu)}
    out = []
    for e in cpu:
        parent = getattr(e, "cpu_parent", None)
        out.append({"name": e.name, "parent": index.get(id(parent), -1) if parent is not None else -1,
                    "seq": getattr(e, "sequence_nr", -1), "fwd": getattr(e, "fwd_thread", 0), "thread": e.thread,
                    "stack": list(e.stack or []), "start": e.time_range.start, "end": e.time_range.end,
                    "kernels": [[k.name, k.duration] for k in getattr(e, "kernels", [])]})
    return out


def main() -> int:
    # first, before torch/JAX start threads or size their pools from the affinity: every thread
    # created from here on inherits the main thread's CPUs
    from gpu_control import cpu_spec, pin_self_from_env

    pinned = pin_self_from_env()
    ap = argparse.ArgumentParser()
    ap.add_argument("workload", choices=sorted(TORCH_BUILDERS) + ["jax"])
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny sizes on the CPU")
    ap.add_argument("--device", default="auto", help="cuda | cpu | auto")
    ap.add_argument("--warmup", type=int, default=None, help="warm-up steps before `ready`")
    ap.add_argument("--batch", type=int, default=None, help="batch size (resnet50; default 64)")
    a = ap.parse_args()

    is_torch = a.workload != "jax"
    info: dict = {"workload": a.workload, "pid": os.getpid(), "python": sys.version.split()[0],
                  "pinned_at_start": pinned}
    if is_torch:
        import torch

        if a.cpu_smoke or a.device == "cpu" or (a.device == "auto" and not torch.cuda.is_available()):
            dev = torch.device("cpu")
        else:
            dev = torch.device("cuda")
        if a.cpu_smoke:
            torch.set_num_threads(1)
        cuda = dev.type == "cuda"
        sync = torch.cuda.synchronize if cuda else (lambda: None)
        step, impl = TORCH_BUILDERS[a.workload](dev, a.cpu_smoke, **({"batch": a.batch} if a.batch else {}))
        info.update(torch=torch.__version__, device=str(dev),
                    gpu=torch.cuda.get_device_name(0) if cuda else None)
    else:
        if a.cpu_smoke or a.device == "cpu":
            os.environ["JAX_PLATFORMS"] = "cpu"
        step, impl = build_jax(a.cpu_smoke)
        sync = lambda: None  # noqa: E731 — the step blocks until ready
        cuda = False
        import jax

        info.update(jax=jax.__version__, device=str(jax.devices()[0]))
    info["impl"] = impl

    warm = a.warmup if a.warmup is not None else (3 if a.cpu_smoke else 10)
    t0 = time.perf_counter()
    for _ in range(warm):
        step()
    sync()
    info["warmup_steps"] = warm
    info["warmup_s"] = round(time.perf_counter() - t0, 3)
    info["rss_bytes"] = rss_bytes()
    info["cpus"] = cpu_spec(os.sched_getaffinity(0))
    info["threads_at_ready"] = len(os.listdir("/proc/self/task"))
    sys.stdout.write("ready " + json.dumps(info) + "\n")
    sys.stdout.flush()

    cpu_split: dict = {}

    def run(n: int) -> list[float]:
        """n steps; their wall times (step() and sync(): until the device is done). ``cpu_split``
        gets the host part of each step (until step() returns: Python, framework, launches) and
        the main thread's and the whole process's CPU time over the n steps. The wait in sync()
        (the device still busy) is not recorded on its own: it is step - host. For JAX the step
        blocks until the result is ready (sync() does nothing), so there host == step."""
        times, host = [], []
        thread0, proc0 = time.thread_time(), time.process_time()
        for _ in range(n):
            t = time.perf_counter()
            step()
            t1 = time.perf_counter()
            sync()
            t2 = time.perf_counter()
            times.append(t2 - t)
            host.append(t1 - t)
        cpu_split.clear()
        cpu_split.update(host_s=[round(h, 7) for h in host],
                         host_median_s=statistics.median(host) if host else None,
                         cpu_main_s=round(time.thread_time() - thread0, 6),
                         cpu_process_s=round(time.process_time() - proc0, 6))
        return times

    def summary(cmd: str, n: int, times: list[float], **extra) -> dict:
        return {"cmd": cmd, "n": n, "step_s": [round(t, 7) for t in times],
                "median_s": statistics.median(times) if times else None,
                "rss_bytes": rss_bytes(), **extra}

    from gpu_control import stdin_lines

    for line in stdin_lines():
        parts = line.split()
        if not parts:
            continue
        try:
            if parts[0] == "quit":
                break
            if parts[0] == "rss":
                say({"cmd": "rss", "rss_bytes": rss_bytes()})
            elif parts[0] == "run":
                n = int(parts[1])
                t = time.perf_counter()
                times = run(n)
                say(summary("run", n, times, wall_s=time.perf_counter() - t, **cpu_split))
            elif parts[0] == "truth":
                if not is_torch:
                    say({"cmd": "truth", "error": "n/a: torch.profiler does not profile JAX"})
                    continue
                from torch.profiler import ProfilerActivity, profile

                n, path = int(parts[1]), parts[2]
                acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
                hooks = mark_modules()
                try:
                    with profile(activities=acts, with_stack=True) as prof:
                        times = run(n)
                finally:
                    for h in hooks:
                        h.remove()
                recs = profiler_records(prof.events())
                with open(path, "w") as fh:
                    json.dump({"steps": n, "events": recs}, fh)
                say(summary("truth", n, times, path=path, events=len(recs)))
                del prof
            elif parts[0] == "torchprof":
                if not is_torch:
                    say({"cmd": "torchprof", "error": "n/a: torch.profiler does not profile JAX"})
                    continue
                import torch
                from torch.profiler import ProfilerActivity, profile

                n = int(parts[1])
                stack = len(parts) > 2 and parts[2] == "stack"
                acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
                t = time.perf_counter()
                with profile(activities=acts, with_stack=stack) as prof:
                    times = run(n)
                t_stop = time.perf_counter()
                fd, path = tempfile.mkstemp(prefix="stacklens-torchprof-", suffix=".json")
                os.close(fd)
                try:
                    prof.export_chrome_trace(path)
                    size = os.path.getsize(path)
                    with open(path, "rb") as fh:  # GPU events present? (a CUPTI conflict shows as 0)
                        blob = fh.read()
                    kernels = blob.count(b'"cat": "kernel"') + blob.count(b'"cat":"kernel"')
                    del blob
                finally:
                    os.unlink(path)
                t_exp = time.perf_counter()
                say(summary("torchprof", n, times, with_stack=stack, trace_bytes=size, trace_kernel_events=kernels,
                            profile_wall_s=t_stop - t, export_s=t_exp - t_stop, **cpu_split))
                del prof
            else:
                say({"cmd": parts[0], "error": f"unknown command {parts[0]!r}"})
        except Exception as e:  # noqa: BLE001 — answer, keep serving
            say({"cmd": parts[0], "error": f"{type(e).__name__}: {e}",
                 "trace": traceback.format_exc()[-2000:]})
    return 0


if __name__ == "__main__":
    sys.exit(main())
