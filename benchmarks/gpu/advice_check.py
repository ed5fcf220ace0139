"""Apply each finding's fix to a workload and measure the speedup (issue 44): estimate vs measured.

    python benchmarks/gpu/advice_check.py --out FILE [--table GEMM.json]     (GPU machine, ~2 min)
    python benchmarks/gpu/advice_check.py --cpu-smoke --out FILE                (CPU: the plumbing)
    python benchmarks/gpu/advice_check.py --compare FILE [--profile CASE=PROFILE ...] [--table T]

Cases (each a job, its finding's rule, and the fix applied), in this order, until --budget-s:
- tf32_gpt2 (fp32_gemm): fp32 training of transformers' GPT2LMHeadModel (12 x 768, random
  weights, batch 16 x 512, AdamW), TF32 off vs on (`set_float32_matmul_precision`, cudnn.allow_tf32);
- tf32_resnet50 (fp32_gemm): fp32 training of torchvision's ResNet-50 (batch 64, 224 x 224, SGD),
  TF32 off vs on; an MLP of other shapes where torchvision is missing;
- graphs_decode (launch_bound): batch-1 greedy decoding (32-token prompt, 64 tokens) of the same
  GPT-2, eager with transformers' DynamicCache vs the fix: a StaticCache and the decode step
  captured once with torch.cuda.graph, replayed per token (also timed: the static cache without
  the graph); no per-token sync in any variant;
- sync_item (sync_stalls): a small GPT-2's training step (4 x 512, batch 8 x 128, TF32 on) with
  `loss.item()` each step vs `loss.detach()` summed on the device.
Steps are timed in ABBA rounds after warm-up (median per step); measured speedup = baseline / fix.

The estimate: each case's baseline is also run under torch.profiler; its kernels (names, GPU
time) and what this script timed (the window, the `.item()` waits, the decoding thread's CPU
time) become a calling-context tree under this file's lines, and the case's rule runs on it with
`--table` as the GEMM speedup table. That checks the rule's model on ideal inputs; a stacklens
recording of the same job, given with `--profile CASE=FILE` to --compare, checks the whole
pipeline. The comparison: estimated speedup 1/(1 - estimated_saving) vs measured, within 25%, or
below the estimate where the finding says it is an upper bound.

Writes FILE (JSON) and FILE with .md (the comparison table). Without transformers (CPU smoke), the
GPT-2 cases use a torch-only transformer and the decode case is skipped, said in the JSON.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import statistics
import time
import traceback
from pathlib import Path
from types import SimpleNamespace

FORMAT = "stacklens.advice_check"
SELF = "benchmarks/gpu/advice_check.py"
HZ = 99                          # the CPU sampling rate the estimate trees say they have
RULES = {"tf32_gpt2": "fp32_gemm", "tf32_resnet50": "fp32_gemm", "graphs_decode": "launch_bound",
         "sync_item": "sync_stalls"}


def set_tf32(torch, on: bool) -> None:
    torch.set_float32_matmul_precision("high" if on else "highest")
    torch.backends.cudnn.allow_tf32 = on


def sync(torch, dev: str) -> None:
    if dev != "cpu":
        torch.cuda.synchronize()


# -- the jobs ----------------------------------------------------------------------------------

def gpt2(torch, dev: str, size: str):
    """(model, impl, vocab): transformers' GPT2LMHeadModel, random weights; a torch-only
    transformer LM of the same shape where transformers is missing."""
    layers, width, heads, vocab = {"full": (12, 768, 12, 50257), "small": (4, 512, 8, 8192),
                                   "tiny": (2, 64, 4, 512)}[size]
    torch.manual_seed(0)
    try:
        import transformers
        from transformers import GPT2Config, GPT2LMHeadModel
        cfg = GPT2Config(n_layer=layers, n_embd=width, n_head=heads, vocab_size=vocab, n_positions=1024,
                         bos_token_id=0, eos_token_id=0)
        with torch.device(dev):
            model = GPT2LMHeadModel(cfg)
        return model, f"transformers {transformers.__version__} GPT2LMHeadModel {layers} x {width}, random weights", vocab
    except ImportError as e:
        nn = torch.nn

        class LM(nn.Module):
            def __init__(self):
                super().__init__()
                self.emb = nn.Embedding(vocab, width)
                block = nn.TransformerEncoderLayer(width, heads, 4 * width, 0.0, "gelu", batch_first=True, norm_first=True)
                self.body = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
                self.head = nn.Linear(width, vocab, bias=False)

            def forward(self, input_ids, labels=None):
                n = input_ids.shape[1]
                mask = torch.triu(torch.full((n, n), float("-inf"), device=input_ids.device), 1)
                logits = self.head(self.body(self.emb(input_ids), mask=mask, is_causal=True))
                loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())
                return SimpleNamespace(loss=loss, logits=logits)

        return LM().to(dev), f"torch-only transformer LM {layers} x {width} (transformers: {type(e).__name__})", vocab


def lm_step(torch, dev: str, size: str, batch: int, seq: int):
    model, impl, vocab = gpt2(torch, dev, size)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, vocab, (batch, seq), device=dev, generator=torch.Generator(device=dev).manual_seed(1))

    def loss():
        opt.zero_grad(set_to_none=True)
        out = model(input_ids=ids, labels=ids).loss
        out.backward()
        opt.step()
        return out

    return loss, impl + f", batch {batch} x {seq}, AdamW"


def resnet_step(torch, dev: str, smoke: bool):
    F = torch.nn.functional
    torch.manual_seed(0)
    batch = 2 if smoke else 64
    try:
        import torchvision
        model = torchvision.models.resnet50(weights=None).to(dev)
        x = torch.randn(batch, 3, 64 if smoke else 224, 64 if smoke else 224, device=dev)
        impl = f"torchvision {torchvision.__version__} resnet50, batch {batch}, SGD"
    except ImportError as e:
        nn, w, batch = torch.nn, 32 if smoke else 4096, 32 if smoke else 2048
        model = nn.Sequential(nn.Linear(w // 4, w), nn.GELU(), nn.Linear(w, w), nn.GELU(), nn.Linear(w, 1000)).to(dev)
        x = torch.randn(batch, w // 4, device=dev)
        impl = f"MLP {w // 4}-{w}-{w}-1000, batch {batch}, SGD (torchvision: {type(e).__name__})"
    y = torch.randint(0, 1000, (batch,), device=dev)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

    def loss():
        opt.zero_grad(set_to_none=True)
        out = F.cross_entropy(model(x), y)
        out.backward()
        opt.step()
        return out

    return loss, impl


class StaticDecoder:
    """Greedy decoding with transformers' StaticCache: the prompt eagerly, then each token one call
    of `step` (fixed shapes, no host sync), captured once in a CUDA graph when `graph`."""

    def __init__(self, torch, model, prompt, tokens: int, graph: bool):
        from transformers import StaticCache

        self.torch, self.model, self.prompt, self.n = torch, model, prompt, tokens
        self.cache = StaticCache(config=model.config, max_cache_len=prompt.shape[1] + tokens)
        dev = prompt.device
        self.tok = torch.zeros(1, 1, dtype=torch.long, device=dev)
        self.pos = torch.zeros(1, 1, dtype=torch.long, device=dev)
        self.out = torch.zeros(1, tokens, dtype=torch.long, device=dev)
        self.graph = None
        if graph:
            self.prefill()
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                for _ in range(3):
                    self.step()
            torch.cuda.current_stream().wait_stream(s)
            self.prefill()
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self.step()

    def prefill(self) -> None:
        p = self.prompt.shape[1]
        self.cache.reset()
        r = self.model(self.prompt, past_key_values=self.cache, use_cache=True,
                       position_ids=self.torch.arange(p, device=self.prompt.device)[None])
        nxt = r.logits[:, -1].argmax(-1, keepdim=True)
        self.tok.copy_(nxt)
        self.out[:, :1].copy_(nxt)
        self.pos.fill_(p)

    def step(self) -> None:
        r = self.model(self.tok, past_key_values=self.cache, use_cache=True, position_ids=self.pos)
        nxt = r.logits[:, -1].argmax(-1, keepdim=True)
        self.out.scatter_(1, self.pos - (self.prompt.shape[1] - 1), nxt)
        self.tok.copy_(nxt)
        self.pos.add_(1)

    def episode(self):
        self.prefill()
        for _ in range(self.n - 1):
            self.graph.replay() if self.graph is not None else self.step()
        return self.out


def eager_decode(torch, model, prompt, tokens: int):
    """The job as written: transformers' DynamicCache, one forward per token."""
    ids, past, out = prompt, None, []
    for _ in range(tokens):
        r = model(ids, past_key_values=past, use_cache=True)
        past = r.past_key_values
        ids = r.logits[:, -1].argmax(-1, keepdim=True)
        out.append(ids)
    return torch.cat(out, 1)


# -- timing and the kernels of a baseline ------------------------------------------------------

def rounds(torch, dev: str, variants: dict, steps: int, nrounds: int, warm: int, per: int = 1) -> dict:
    """variants: name -> (enter, run); `run()` returns the seconds it spent waiting in a sync (or
    None). ABBA order after `warm` runs of each; per variant the median ms per step (a run is `per`
    steps), the thread's CPU ms and the sync wait ms per step."""
    names = list(variants)
    for name in names:
        enter, run = variants[name]
        enter()
        for _ in range(warm):
            run()
        sync(torch, dev)
    order = [n for k in range(nrounds) for n in (names if k % 2 == 0 else names[::-1])]
    got: dict[str, list[tuple[float, float, float]]] = {n: [] for n in names}
    for name in order:
        enter, run = variants[name]
        enter()
        sync(torch, dev)
        t, c, wait = time.perf_counter(), time.thread_time(), 0.0
        for _ in range(steps):
            wait += run() or 0.0
        sync(torch, dev)
        k = 1e3 / (steps * per)
        got[name].append(((time.perf_counter() - t) * k, (time.thread_time() - c) * k, wait * k))
    return {n: {"step_ms": round(statistics.median(g[0] for g in v), 4),
                "rounds_ms": [round(g[0], 4) for g in v],
                "thread_cpu_ms": round(statistics.median(g[1] for g in v), 4),
                "sync_wait_ms": round(statistics.median(g[2] for g in v), 4)} for n, v in got.items()}


def kernel_records(torch, dev: str, run, n: int) -> dict[str, list]:
    """name -> [kind, GPU µs, count] of what `n` calls of `run` executed on the GPU (torch.profiler);
    on the CPU, its top-level CPU ops (so that the smoke exercises the same path)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = dev != "cpu"
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        for _ in range(n):
            run()
        sync(torch, dev)
    out: dict[str, list] = {}
    for e in prof.events():
        if cuda and e.device_type != torch.autograd.DeviceType.CUDA:
            continue
        if not cuda and e.cpu_parent is not None:
            continue
        us = e.time_range.elapsed_us() if cuda else e.self_cpu_time_total
        kind = "memcpy" if e.name.startswith("Memcpy") else "memset" if e.name.startswith("Memset") else "kernel"
        rec = out.setdefault(e.name, [kind, 0.0, 0])
        rec[1] += us
        rec[2] += 1
    return out


# -- the rule's estimate on a tree of those records --------------------------------------------

def tree_estimate(rule: str, lines: list[dict], wall_ns: float, table: str | None) -> dict:
    """Run the analyzer on a tree of `lines` (each: func, line, kernels from kernel_records,
    optional cpu_ns of the one thread and sync_wait_ns of an `.item()`) over a window of
    `wall_ns`; the finding of `rule` with the largest saving, as `finding_estimate` says it.
    A failure is returned, not raised: the case's measurements stand without it."""
    try:
        return _tree_estimate(rule, lines, wall_ns, table)
    except Exception as e:
        return {"rule": rule, "fired": False, "error": f"{type(e).__name__}: {e}"}


def _tree_estimate(rule: str, lines: list[dict], wall_ns: float, table: str | None) -> dict:
    from stacklens.analyzer import analyze
    from stacklens.cct import CCT, METRICS, Frame

    t = CCT(METRICS)
    main = (Frame.python(SELF, "main", 1),)
    for ln in lines:
        here = main + (Frame.python(SELF, ln["func"], ln["line"]),)
        for name, (kind, us, n) in ln["kernels"].items():
            leaf = Frame(kind, name) if kind != "kernel" else Frame.kernel(name)
            t.add_many(here + (Frame.api("cuLaunchKernel"), leaf),
                       {"gpu_time_ns": round(us * 1e3), "kernel_count": n, "launch_count": n})
        if ln.get("sync_wait_ns"):
            t.add_many(here + (Frame.op("aten::item"), Frame.api("cuStreamSynchronize")),
                       {"sync_wait_ns": round(ln["sync_wait_ns"])})
        if ln.get("cpu_ns"):
            t.add_sample(here, "cpu_samples", 1, max(1, round(ln["cpu_ns"] * HZ / 1e9)))
    snap = t.snapshot(meta={"duration_ns": round(wall_ns), "cpu_hz": HZ,
                            "synthetic": "advice_check: torch.profiler kernel records in a timed window"})
    return finding_estimate(analyze(snap, _config(table)), rule)


def _config(table: str | None) -> dict:
    return {"rules": {"fp32_gemm": {"speedup_table": table}}} if table is not None else {}


def finding_estimate(found: list, rule: str) -> dict:
    """The estimate of `rule`'s finding with the largest saving: saving, speedup 1/(1 - saving),
    whether it says it is an upper bound or rests on a guessed factor."""
    mine = [f for f in found if f.rule == rule]
    if not mine:
        return {"rule": rule, "fired": False, "top_rule": found[0].rule if found else None}
    f = max(mine, key=lambda f: f.estimated_saving)
    s = f.estimated_saving
    return {"rule": rule, "fired": True, "severity": f.severity, "estimated_saving": s,
            "estimated_speedup": round(1 / (1 - s), 4) if s < 1 else None, "top_rule": found[0].rule,
            "upper_bound": "upper bound" in f.fix, "guessed": "guessed" in f.fix,
            "title": f.title, "fix": f.fix, "evidence": f.evidence}


# -- the cases ---------------------------------------------------------------------------------

def _quiet(run):
    return lambda: (run(), None)[1]


def case_tf32(torch, dev: str, a, which: str) -> dict:
    smoke = a.cpu_smoke
    if which == "tf32_gpt2":
        run, impl = lm_step(torch, dev, "tiny" if smoke else "full", *((2, 32) if smoke else (16, 512)))
    else:
        run, impl = resnet_step(torch, dev, smoke)
    variants = {"fp32": (lambda: set_tf32(torch, False), _quiet(run)), "tf32": (lambda: set_tf32(torch, True), _quiet(run))}
    res = rounds(torch, dev, variants, steps=2 if smoke else 5, nrounds=2 if smoke else 4, warm=1 if smoke else 3)
    set_tf32(torch, False)
    n = 2
    recs = kernel_records(torch, dev, run, n)
    est = tree_estimate("fp32_gemm", [{"func": "train_step", "line": 1, "kernels": recs}],
                        res["fp32"]["step_ms"] * 1e6 * n, a.table)
    return {"impl": impl, "fix": "TF32 on: set_float32_matmul_precision('high'), cudnn.allow_tf32 = True",
            "baseline": "fp32", "fixed": "tf32", "variants": res, "estimate": est,
            "measured_speedup": round(res["fp32"]["step_ms"] / res["tf32"]["step_ms"], 4)}


def case_decode(torch, dev: str, a) -> dict:
    if importlib.util.find_spec("transformers") is None:    # the fix needs its StaticCache
        return {"skipped": "transformers is not importable: the decode case needs its StaticCache"}
    model, impl, vocab = gpt2(torch, dev, "tiny" if a.cpu_smoke else "full")
    model.eval()
    n = 8 if a.cpu_smoke else 64
    prompt = (torch.arange(32, device=dev) * 7 % vocab)[None]
    graph, graph_error = dev != "cpu", None
    with torch.no_grad():
        eager = eager_decode(torch, model, prompt, n)
        variants = {"eager": (None, lambda: eager_decode(torch, model, prompt, n)),
                    "static_cache": (StaticDecoder(torch, model, prompt, n, graph=False), None)}
        try:
            variants["cuda_graph"] = (StaticDecoder(torch, model, prompt, n, graph=graph), None)
        except Exception as e:      # keep the eager and static-cache numbers; say why there is no graph
            graph_error = f"{type(e).__name__}: {e}"
        same = {k: round(float((d.episode() == eager).float().mean()), 4) for k, (d, _) in variants.items() if d}
        res = rounds(torch, dev, {k: (lambda: None, _quiet(d.episode if d else f)) for k, (d, f) in variants.items()},
                     steps=1, nrounds=2 if a.cpu_smoke else 6, warm=1, per=n)
        recs = kernel_records(torch, dev, variants["eager"][1], 1)
    base = res["eager"]
    est = tree_estimate("launch_bound", [{"func": "eager_decode", "line": 1, "kernels": recs,
                                          "cpu_ns": base["thread_cpu_ms"] * 1e6 * n}], base["step_ms"] * 1e6 * n, a.table)
    fixed = res.get("cuda_graph")
    return {"impl": impl + f", batch 1, prompt 32, {n} tokens greedy", "baseline": "eager", "fixed": "cuda_graph",
            "fix": "StaticCache + the decode step captured with torch.cuda.graph" + ("" if graph else " (CPU: not captured)"),
            "graph_error": graph_error, "variants": res, "tokens_equal_to_eager": same, "estimate": est,
            "measured_speedup": round(base["step_ms"] / fixed["step_ms"], 4) if fixed else None,
            "static_cache_alone_speedup": round(base["step_ms"] / res["static_cache"]["step_ms"], 4)}


def case_sync(torch, dev: str, a) -> dict:
    run, impl = lm_step(torch, dev, "tiny" if a.cpu_smoke else "small", *((2, 32) if a.cpu_smoke else (8, 128)))
    acc = torch.zeros((), device=dev)

    def with_item():
        loss = run()
        t = time.perf_counter()
        loss.item()
        return time.perf_counter() - t

    def on_device():
        acc.add_(run().detach())

    tf32 = lambda: set_tf32(torch, True)  # noqa: E731
    res = rounds(torch, dev, {"item": (tf32, with_item), "no_sync": (tf32, on_device)},
                 steps=2 if a.cpu_smoke else 20, nrounds=2 if a.cpu_smoke else 4, warm=1 if a.cpu_smoke else 3)
    n = 5
    recs = kernel_records(torch, dev, run, n)
    base = res["item"]
    est = tree_estimate("sync_stalls", [{"func": "train_step", "line": 1, "kernels": recs},
                                        {"func": "with_item", "line": 2, "kernels": {}, "sync_wait_ns": base["sync_wait_ms"] * 1e6 * n}],
                        base["step_ms"] * 1e6 * n, a.table)
    set_tf32(torch, False)
    return {"impl": impl + ", TF32 on", "baseline": "item", "fixed": "no_sync", "variants": res, "estimate": est,
            "fix": "loss.item() each step -> loss.detach() summed on the device",
            "measured_speedup": round(base["step_ms"] / res["no_sync"]["step_ms"], 4)}


def run_case(torch, dev: str, a, case: str) -> dict:
    t = time.monotonic()
    try:
        if case.startswith("tf32_"):
            rec = case_tf32(torch, dev, a, case)
        else:
            rec = (case_decode if case == "graphs_decode" else case_sync)(torch, dev, a)
    except Exception as e:  # one case failing must not lose the others' numbers
        rec = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}
    gc.collect()
    if dev != "cpu":
        torch.cuda.empty_cache()
    return {"rule": RULES[case], **rec, "seconds": round(time.monotonic() - t, 1)}


# -- estimate vs measured ----------------------------------------------------------------------

def compare(measured: dict, profiles: dict[str, str], table: str | None = None) -> list[dict]:
    """One row per case and estimate: the tree's (from the run) and each given stacklens profile's."""
    rows = []
    for case, rec in measured.get("cases", {}).items():
        sources = [("rule on the run's torch.profiler tree", rec["estimate"])] if rec.get("estimate") else []
        if case in profiles:
            from stacklens.analyzer import analyze
            from stacklens.cct.export import load

            sources.append((f"stacklens profile {Path(profiles[case]).name}",
                            finding_estimate(analyze(load(profiles[case]), _config(table)), rec["rule"])))
        for source, est in sources:
            rows.append(judge(case, rec["rule"], source, est, rec.get("measured_speedup")))
        if not sources:
            rows.append({"case": case, "rule": rec["rule"], "source": "-", "verdict": rec.get("skipped") or rec.get("error", "no estimate")})
    return rows


def judge(case: str, rule: str, source: str, est: dict, measured: float | None) -> dict:
    row = {"case": case, "rule": rule, "source": source, "measured": measured,
           "estimated": est.get("estimated_speedup"), "upper_bound": est.get("upper_bound", False),
           "guessed": est.get("guessed", False)}
    if est.get("error"):
        row["verdict"] = f"no estimate: {est['error']}"
    elif not est.get("fired"):
        row["verdict"] = f"{rule} did not fire (top finding: {est.get('top_rule')})"
    elif not measured or not row["estimated"]:
        row["verdict"] = "no measurement"
    else:
        ratio = measured / row["estimated"]
        row["ratio"] = round(ratio, 3)
        row["verdict"] = ("within 25%" if abs(ratio - 1) <= 0.25 else
                          "below the upper bound" if row["upper_bound"] and ratio < 1 else f"off: measured/estimated {ratio:.2f}")
    return row


def markdown(rows: list[dict], meta: dict) -> str:
    head = (f"Device: {meta.get('device', '?')}; torch {meta.get('torch', '?')}; GEMM table: {meta.get('table') or 'the committed one'}\n\n"
            "| case | rule | estimate from | estimated speedup | measured speedup | verdict |\n|---|---|---|---|---|---|\n")
    def fmt(v, flag=""):
        return "-" if v is None else f"{v:.2f}x{flag}"
    return head + "".join(
        f"| {r['case']} | {r['rule']} | {r['source']} | "
        f"{fmt(r.get('estimated'), ' (upper bound)' if r.get('upper_bound') else ' (guessed factor)' if r.get('guessed') else '')} | "
        f"{fmt(r.get('measured'))} | {r['verdict']} |\n" for r in rows)


# -- main --------------------------------------------------------------------------------------

def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="the JSON to write (and its .md table beside it)")
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny versions on the CPU: checks the plumbing only")
    ap.add_argument("--cases", default=",".join(RULES), help=f"comma-separated, of {', '.join(RULES)}")
    ap.add_argument("--table", help="GEMM speedup table for the fp32_gemm estimate (default: the committed one)")
    ap.add_argument("--budget-s", type=float, default=200.0, help="start no case after this (default 200)")
    ap.add_argument("--compare", metavar="FILE", help="only compare: a JSON this script wrote, with --profile")
    ap.add_argument("--profile", action="append", default=[], metavar="CASE=FILE",
                    help="a stacklens profile (cct export JSON, .gz too) of that case's baseline job")
    a = ap.parse_args()
    profiles = dict(p.split("=", 1) for p in a.profile)
    if a.compare:
        measured = json.loads(Path(a.compare).read_text())
        text = markdown(compare(measured, profiles, a.table), dict(measured.get("meta", {}), table=a.table or measured.get("meta", {}).get("table")))
        print(text)
        if a.out:
            Path(a.out).write_text(text)
        return 0
    if not a.out:
        ap.error("--out is required to measure")
    import torch

    dev = "cpu" if a.cpu_smoke else "cuda"
    if dev == "cuda" and not torch.cuda.is_available():
        ap.error("no CUDA device: use --cpu-smoke to check the plumbing on a CPU")
    meta = {"device": torch.cuda.get_device_name(0) if dev == "cuda" else "cpu", "torch": torch.__version__,
            "cpu_smoke": a.cpu_smoke, "table": a.table, "script": SELF, "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            **{m: _version(m) for m in ("transformers", "torchvision")}}
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    doc = {"format": FORMAT, "version": 1, "meta": meta, "cases": {}}
    t0 = time.monotonic()
    for case in [c for c in a.cases.split(",") if c]:
        if time.monotonic() - t0 > a.budget_s:
            doc["cases"][case] = {"rule": RULES[case], "skipped": f"budget of {a.budget_s:.0f} s spent"}
            continue
        doc["cases"][case] = rec = run_case(torch, dev, a, case)
        print(json.dumps({case: {k: rec.get(k) for k in ("measured_speedup", "error", "skipped", "seconds")}
                          | {"estimate": (rec.get("estimate") or {}).get("estimated_speedup")}}), flush=True)
        out.write_text(json.dumps(doc, indent=1, default=str) + "\n")
    meta["seconds"] = round(time.monotonic() - t0, 1)
    out.write_text(json.dumps(doc, indent=1, default=str) + "\n")
    text = markdown(compare(doc, profiles, a.table), meta)
    out.with_suffix(".md").write_text(text)
    print(text, flush=True)
    return 0


def _version(module: str) -> str | None:
    try:
        return __import__(module).__version__
    except ImportError:
        return None


if __name__ == "__main__":
    raise SystemExit(main())
