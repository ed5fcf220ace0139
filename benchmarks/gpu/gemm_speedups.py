"""GEMM time in fp32, TF32 and bf16 on the GPU, by shape and kernel (issue 44): the table the
fp32_gemm rule reads (analyzer/rules/_speedups.py) instead of one whole-step factor.

    python benchmarks/gpu/gemm_speedups.py --out FILE [--budget-s 100]   (GPU machine, ~1.5 min)
    python benchmarks/gpu/gemm_speedups.py --cpu-smoke --out FILE        (CPU: the plumbing only)

Shapes of transformer training and inference, and of ResNet-50's convolutions:
- linear layers (nn.Linear: `F.linear(x, W, b)`; GPT-2's Conv1D: `addmm(b, x, W)`) of GPT-2 small,
  a 1B and a 7B model, at M = 512..16384 tokens, with the two GEMMs of their backward (dgrad
  `dY @ W`, wgrad `dY^T @ X`, transposed as autograd runs them); batch-1 and batch-8 decoding
  (M = 1, 8, forward only);
- convolutions of ResNet-50 at batch 64, forward and backward (`aten.convolution_backward`).

Per shape and mode: GPU time per call from CUDA events around back-to-back calls queued behind a
`torch.cuda._sleep` (so small calls do not wait on the CPU), after warm-up, the median of the
repeats; the kernels each mode ran (torch.profiler, one call per shape and mode); the speedup of
TF32 (`torch.set_float32_matmul_precision('high')`, `cudnn.allow_tf32`) and bf16 (inputs in
bfloat16) over fp32 (both off). Rows are measured in order of use (the shapes of
benchmarks/gpu/advice_check.py's jobs first) until --budget-s, and the JSON is written as it goes.
With --cpu-smoke a tiny grid runs on the CPU (TF32 does nothing there; the "kernels" are the CPU
ops) and the table is marked `cpu_smoke`, which the analyzer never uses.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

FORMAT = "stacklens.gemm_speedups"
MODES = ("fp32", "tf32", "bf16")
# (model, layer, K, N, bias, layout): `linear` = F.linear(x, W[N,K], b), `conv1d` = addmm(b, x, W[K,N])
GPT2 = [("gpt2", "attn.c_attn", 768, 2304, True), ("gpt2", "attn.c_proj", 768, 768, True),
        ("gpt2", "mlp.c_fc", 768, 3072, True), ("gpt2", "mlp.c_proj", 3072, 768, True)]
LAYERS = ([(*g, "conv1d") for g in GPT2] + [("gpt2", "lm_head", 768, 50257, False, "linear")]
          + [(*g, "linear") for g in GPT2]
          + [("1b", "attn", 2048, 2048, False, "linear"), ("1b", "mlp.up", 2048, 8192, False, "linear"),
             ("1b", "mlp.down", 8192, 2048, False, "linear"), ("7b", "attn", 4096, 4096, False, "linear"),
             ("7b", "mlp.up", 4096, 11008, False, "linear"), ("7b", "mlp.down", 11008, 4096, False, "linear")])
TOKENS = (8192, 2048, 512, 16384)
DECODE = (1, 8)
# ResNet-50 convolutions at batch 64: (C_in, C_out, H=W, kernel, stride)
CONVS = [(3, 64, 224, 7, 2), (64, 64, 56, 3, 1), (64, 256, 56, 1, 1), (256, 64, 56, 1, 1), (128, 128, 28, 3, 1),
         (512, 128, 28, 1, 1), (256, 256, 14, 3, 1), (1024, 256, 14, 1, 1), (512, 512, 7, 3, 1), (2048, 512, 7, 1, 1)]
CONV_BATCH = 64
SMOKE_LAYERS = [("tiny", "proj", 64, 96, True, "linear"), ("tiny", "c_fc", 64, 96, True, "conv1d")]


def grid(smoke: bool) -> list[dict]:
    """The shapes, most used first (the largest M last): each a dict with `op`, `gemm` and sizes."""
    layers, tokens, decode = (SMOKE_LAYERS, (32,), (1,)) if smoke else (LAYERS, TOKENS, DECODE)
    convs, batch = ([(8, 8, 16, 3, 1)], 2) if smoke else (CONVS, CONV_BATCH)
    rows = []
    for m in (*tokens[:-1], 0, tokens[-1]):
        for model, layer, k, n, bias, op in layers:
            if m == 0:        # decoding: batch 1 and 8, forward only
                rows.extend(dict(op=op, gemm="fwd", model=model, layer=layer, m=d, k=k, n=n, bias=bias) for d in decode)
                continue
            for gemm in ("fwd", "dgrad", "wgrad"):
                rows.append(dict(op=op, gemm=gemm, model=model, layer=layer, m=m, k=k, n=n, bias=bias))
        if m == tokens[0]:
            for cin, cout, hw, kk, s in convs:
                for gemm in ("fwd", "bwd"):
                    rows.append(dict(op="conv2d", gemm=gemm, model="resnet50", layer=f"{cin}->{cout} {kk}x{kk}/{s}",
                                     batch=batch, cin=cin, cout=cout, hw=hw, kernel=kk, stride=s))
    return rows


def make_call(torch, row: dict, mode: str, dev: str):
    """A no-argument function running the row's GEMM in `mode` on fresh random inputs."""
    import torch.nn.functional as F

    dt = torch.bfloat16 if mode == "bf16" else torch.float32
    g = torch.Generator(device=dev).manual_seed(0)

    def r(*shape):
        return torch.randn(*shape, device=dev, dtype=dt, generator=g)

    if row["op"] == "conv2d":
        b, ci, co, hw, kk, s = (row[x] for x in ("batch", "cin", "cout", "hw", "kernel", "stride"))
        x, w, pad = r(b, ci, hw, hw), r(co, ci, kk, kk), kk // 2
        if row["gemm"] == "fwd":
            return lambda: F.conv2d(x, w, stride=s, padding=pad)
        gy = r(*F.conv2d(x, w, stride=s, padding=pad).shape)
        return lambda: torch.ops.aten.convolution_backward(gy, x, w, None, [s, s], [pad, pad], [1, 1], False,
                                                           [0, 0], 1, [True, True, False])
    m, k, n = row["m"], row["k"], row["n"]
    bias = r(n) if row["bias"] else None
    if row["gemm"] == "fwd":
        x = r(m, k)
        if row["op"] == "conv1d":
            w = r(k, n)
            return (lambda: torch.addmm(bias, x, w)) if bias is not None else (lambda: x @ w)
        w = r(n, k)
        return lambda: F.linear(x, w, bias)
    dy = r(m, n)
    if row["gemm"] == "dgrad":
        w = r(n, k) if row["op"] == "linear" else r(k, n)
        return (lambda: dy @ w) if row["op"] == "linear" else (lambda: dy @ w.t())
    x = r(m, k)
    return (lambda: dy.t() @ x) if row["op"] == "linear" else (lambda: x.t() @ dy)


def set_mode(torch, mode: str) -> None:
    torch.set_float32_matmul_precision("high" if mode == "tf32" else "highest")
    torch.backends.cudnn.allow_tf32 = mode == "tf32"


def time_call(torch, fn, dev: str, reps: int, batch_ms: float) -> float:
    """Milliseconds per call: the median over `reps` batches of back-to-back calls."""
    for _ in range(2):
        fn()
    if dev == "cpu":
        t = time.perf_counter()
        fn()
        n = max(1, min(50, int(batch_ms / max((time.perf_counter() - t) * 1e3, 1e-3))))
        out = []
        for _ in range(reps):
            t = time.perf_counter()
            for _ in range(n):
                fn()
            out.append((time.perf_counter() - t) * 1e3 / n)
        return statistics.median(out)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def batch(n: int) -> float:
        # a sleeping kernel first: the n calls queue up behind it and then run back to back
        torch.cuda._sleep(int(2e9 * min(20.0, 0.5 + 0.03 * n) / 1e3))
        start.record()
        for _ in range(n):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / n

    n = max(1, min(200, int(batch_ms / max(batch(1), 1e-3))))
    return statistics.median(batch(n) for _ in range(reps))


def kernels_of(torch, calls: list, dev: str) -> list[list[dict]]:
    """For each call, the kernels it ran ([{name, us}], most time first), from one torch.profiler
    session over all of them; on the CPU, the top-level CPU ops instead."""
    from torch.profiler import ProfilerActivity, profile, record_function

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev != "cpu" else [])
    with profile(activities=acts) as prof:
        for i, fn in enumerate(calls):
            with record_function(f"gemm_row_{i}"):
                fn()
            if dev != "cpu":
                torch.cuda.synchronize()
    out: list[list[dict]] = [[] for _ in calls]
    for ev in prof.events():
        if not ev.name.startswith("gemm_row_") or ev.device_type != torch.autograd.DeviceType.CPU:
            continue
        acc: dict[str, float] = {}
        stack = list(ev.cpu_children)
        while stack:
            e = stack.pop()
            stack.extend(e.cpu_children)
            for kn in e.kernels:
                acc[kn.name] = acc.get(kn.name, 0.0) + kn.duration
            if dev == "cpu" and e.cpu_parent is ev:
                acc[e.name] = acc.get(e.name, 0.0) + e.cpu_time_total
        out[int(ev.name.rpartition("_")[2])] = [{"name": k, "us": round(v, 3)} for k, v in
                                                sorted(acc.items(), key=lambda kv: -kv[1])]
    return out


def family(name: str) -> str | None:
    try:
        from stacklens.analyzer.rules._speedups import kernel_family
    except ImportError:
        return None
    return kernel_family(name)


def measure(torch, rows: list[dict], dev: str, a, save) -> list[dict]:
    """Each row timed in every mode, then the kernels of every (row, mode); stops adding rows at
    the budget (a fifth of it kept for the profiler pass). `save(rows)` after each step."""
    t0 = time.monotonic()
    done = []
    for row in rows:
        if time.monotonic() - t0 > 0.8 * a.budget_s:
            print(f"budget: {len(done)} of {len(rows)} rows measured", flush=True)
            break
        row = dict(row, modes={})
        for mode in MODES:
            set_mode(torch, mode)
            try:
                row["modes"][mode] = {"ms": round(time_call(torch, make_call(torch, row, mode, dev), dev, a.reps, a.batch_ms), 5)}
            except RuntimeError as e:           # out of memory, an unsupported dtype on this device
                row["modes"][mode] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
            if dev != "cpu":
                torch.cuda.empty_cache()
        fp32 = row["modes"]["fp32"].get("ms")
        row["speedup"] = {m: round(fp32 / row["modes"][m]["ms"], 4) for m in MODES[1:]
                          if fp32 and row["modes"][m].get("ms")}
        done.append(row)
        save(done)
        print(json.dumps({k: row[k] for k in ("op", "gemm", "model", "layer")} | {"m": row.get("m"), "speedup": row["speedup"]}), flush=True)
    for mode in MODES:
        set_mode(torch, mode)
        ok = [r for r in done if r["modes"][mode].get("ms")]
        for start in range(0, len(ok), 24):          # bounded memory: 24 rows' inputs at a time
            part = ok[start:start + 24]
            for r, ks in zip(part, kernels_of(torch, [make_call(torch, r, mode, dev) for r in part], dev)):
                r["modes"][mode]["kernels"] = ks
                if mode == "fp32" and ks:
                    r["family"] = family(ks[0]["name"])
            save(done)
            if dev != "cpu":
                torch.cuda.empty_cache()
    set_mode(torch, "fp32")
    return done


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="the JSON table to write")
    ap.add_argument("--cpu-smoke", action="store_true", help="a tiny grid on the CPU: checks the plumbing only")
    ap.add_argument("--budget-s", type=float, default=100.0, help="stop adding rows after this (default 100)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--batch-ms", type=float, default=8.0, help="GPU time of one timed batch of calls")
    a = ap.parse_args()
    import torch

    dev = "cpu" if a.cpu_smoke else "cuda"
    if dev == "cuda" and not torch.cuda.is_available():
        ap.error("no CUDA device: use --cpu-smoke to check the plumbing on a CPU")
    if a.cpu_smoke:
        a.reps, a.batch_ms = 2, 1.0
    meta = {"device": torch.cuda.get_device_name(0) if dev == "cuda" else "cpu", "torch": torch.__version__,
            "cuda": torch.version.cuda, "cpu_smoke": a.cpu_smoke, "script": "benchmarks/gpu/gemm_speedups.py",
            "method": "CUDA events around back-to-back calls behind a sleep kernel, after 2 warm-up calls; median "
                      f"of {a.reps} batches of ~{a.batch_ms} ms; kernels from one torch.profiler call per row and mode",
            "modes": {"fp32": "set_float32_matmul_precision('highest'), cudnn.allow_tf32 = False",
                      "tf32": "set_float32_matmul_precision('high'), cudnn.allow_tf32 = True",
                      "bf16": "inputs and weights in bfloat16"},
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    t = time.monotonic()

    def save(rows: list[dict]) -> None:
        meta["seconds"] = round(time.monotonic() - t, 1)
        tmp = out.with_name(out.name + ".tmp")      # replaced whole: a kill mid-write leaves the last table
        tmp.write_text(json.dumps({"format": FORMAT, "version": 1, "meta": meta, "rows": rows}, indent=1) + "\n")
        tmp.replace(out)

    rows = measure(torch, grid(a.cpu_smoke), dev, a, save)
    save(rows)
    print(f"wrote {out}: {len(rows)} rows in {meta['seconds']} s", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
