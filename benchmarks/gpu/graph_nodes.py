"""What CUPTI says about CUDA-graph replays (issue 27; run on the GPU machine, plain torch + cupti-python):

    python benchmarks/gpu/graph_nodes.py --out DIR

Two children, each writing DIR/graph_nodes-<case>.json.gz (the records, for the join's tests):
- ``manual``: an eager MLP captured with ``torch.cuda.graph`` while CUPTI collects kernel and
  driver/runtime API records, replayed 3 times; then a second graph captured, replayed twice.
  Says: whether captured launches produce API records (and kernel records: they should not),
  what ``graphId`` / ``graphNodeId`` replayed kernels carry, whether node ids repeat over
  replays and follow the capture order.
- ``inductor``: the four-block transformer of tests/targets/compiled_transformer.py compiled with
  ``mode="reduce-overhead"`` (cudagraph trees), its graphs recorded before CUPTI starts; then two
  training steps' kernel records, and the messages the agent's Inductor reader
  (inject/agent/inductor.py) sends for the generated modules: how replayed kernels' names match
  the wrapper modules' kernels.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _collector():
    from cupti import cupti
    K = cupti.ActivityKind
    kernels, apis = [], []

    def requested():
        return 8 << 20, 0

    def completed(acts):
        for r in acts:
            if r.kind == K.CONCURRENT_KERNEL:
                kernels.append([int(r.correlation_id), int(getattr(r, "graph_id", 0) or 0),
                                int(getattr(r, "graph_node_id", 0) or 0), int(r.start), int(r.end),
                                int(getattr(r, "stream_id", 0) or 0), str(r.name)])
            elif r.kind in (K.DRIVER, K.RUNTIME):
                apis.append([int(r.correlation_id), "driver" if r.kind == K.DRIVER else "runtime",
                             int(getattr(r, "cbid", -1)), int(r.start), int(r.end)])

    cupti.activity_register_callbacks(requested, completed)
    for k in (K.CONCURRENT_KERNEL, K.DRIVER, K.RUNTIME):
        cupti.activity_enable(k)

    def flush():
        cupti.activity_flush_all(1)
    return kernels, apis, flush


def _api_names(apis) -> dict:
    """cbid -> name where cupti-python can say it (best effort: names only help reading)."""
    from cupti import cupti
    out = {}
    for _c, dom, cbid, _s, _e in apis:
        key = f"{dom}:{cbid}"
        if key in out:
            continue
        try:
            d = cupti.CallbackDomain.DRIVER_API if dom == "driver" else cupti.CallbackDomain.RUNTIME_API
            out[key] = str(cupti.get_callback_name(d, cbid))
        except Exception as e:  # noqa: BLE001 - names are optional
            out[key] = f"? {type(e).__name__}"
    return out


def manual() -> dict:
    import torch
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 1024),
                                torch.nn.GELU(), torch.nn.Linear(1024, 512)).cuda()
    x = torch.randn(64, 512, device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s), torch.no_grad():
        for _ in range(3):
            model(x)
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    kernels, apis, flush = _collector()
    marks = {}
    g = torch.cuda.CUDAGraph()
    flush()
    marks["capture_from"] = (len(kernels), len(apis))
    with torch.cuda.graph(g), torch.no_grad():
        y = model(x)
    torch.cuda.synchronize()
    flush()
    marks["capture_to"] = (len(kernels), len(apis))
    for _ in range(3):
        g.replay()
    torch.cuda.synchronize()
    flush()
    marks["replays_to"] = (len(kernels), len(apis))
    g2 = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g2), torch.no_grad():
        y2 = model(y)
    for _ in range(2):
        g2.replay()
        g.replay()
    torch.cuda.synchronize()
    flush()
    marks["end"] = (len(kernels), len(apis))
    return {"kernels": kernels, "apis": apis, "marks": marks, "api_names": _api_names(apis),
            "out": float(y2.float().abs().sum())}


def inductor() -> dict:
    import torch
    sys.path.insert(0, str(REPO / "tests" / "targets"))
    from compiled_transformer import Model
    from stacklens.inject.agent.inductor import InductorWatcher

    torch.manual_seed(0)
    model = Model().cuda()
    step_fn = torch.compile(model, mode="reduce-overhead")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(8, 512, 1024, device="cuda")

    def step():
        opt.zero_grad(set_to_none=True)
        step_fn(x).backward()
        opt.step()

    for _ in range(6):
        step()
    torch.cuda.synchronize()
    kernels, apis, flush = _collector()
    for _ in range(2):
        step()
    torch.cuda.synchronize()
    flush()
    sent, notes = [], []
    w = InductorWatcher(lambda m: sent.append(m) or True, lambda lvl, msg: notes.append([lvl, msg]))
    w.poll()
    w.last_scan = None
    w.poll()
    return {"kernels": kernels, "apis": apis, "inductor": sent, "notes": notes, "api_names": _api_names(apis),
            "codecache": _codecache()}


def _codecache() -> dict:
    """What Inductor's code cache holds: its line maps' shapes and the generated modules' files."""
    from torch._inductor.codecache import PyCodeCache
    lm = getattr(PyCodeCache, "linemaps", None)
    out = {"linemaps_type": str(type(lm)),
           "linemaps": {str(p): ([len(x) for x in v] if isinstance(v, (list, tuple)) else str(type(v)))
                        for p, v in (lm.items() if isinstance(lm, dict) else ())}}
    mods = getattr(PyCodeCache, "modules", None)
    out["modules_type"] = str(type(mods))
    files = {}
    for m in (mods.values() if isinstance(mods, dict) else (mods or ())):
        f = getattr(m, "__file__", None)
        if isinstance(f, str) and f not in files and os.path.getsize(f) < 4 << 20:
            files[f] = open(f).read()
    out["files"] = files
    return out


def summary(case: str, d: dict) -> dict:
    ks = d["kernels"]
    graph = [k for k in ks if k[1]]
    out = {"case": case, "kernels": len(ks), "graph_kernels": len(graph),
           "graph_ids": sorted({k[1] for k in graph}), "node_id_zero": sum(1 for k in graph if not k[2])}
    by_corr: dict = {}
    for k in graph:
        by_corr.setdefault(k[0], []).append(k)
    reps = []
    for corr, rs in by_corr.items():
        rs.sort(key=lambda k: k[3])
        nodes = [k[2] for k in rs]
        reps.append({"corr": corr, "graph": rs[0][1], "n": len(rs), "nodes_sorted_by_start": nodes == sorted(nodes),
                     "first_nodes": nodes[:6], "streams": sorted({k[5] for k in rs})})
    out["replays"] = reps[:12]
    by_graph: dict = {}
    for r in reps:
        by_graph.setdefault(r["graph"], []).append(r)
    out["node_ids_repeat"] = {str(gid): len({tuple(x["first_nodes"]) for x in rr}) == 1 for gid, rr in by_graph.items()}
    if case == "manual":
        m = d["marks"]
        a0, a1 = m["capture_from"][1], m["capture_to"][1]
        out["capture_kernel_records"] = m["capture_to"][0] - m["capture_from"][0]
        cap = d["apis"][a0:a1]
        names = d["api_names"]
        out["capture_api_records"] = {}
        for c in cap:
            n = names.get(f"{c[1]}:{c[2]}", str(c[2]))
            out["capture_api_records"][n] = out["capture_api_records"].get(n, 0) + 1
    if case == "inductor":
        out["modules"] = len({m["path"] for m in d["inductor"]})
        cc = d["codecache"]
        out["codecache"] = {k: v for k, v in cc.items() if k != "files"}
        out["codecache"]["files"] = len(cc["files"])
        defined = set()
        import re
        for m in d["inductor"]:
            for r in m["r"]:
                if r[0] == "S":
                    mm = re.match(r"^(\w+) = async_compile\.\w+\(", r[2])
                    if mm:
                        defined.add(mm.group(1))
        names = [k[6] for k in graph]
        out["graph_kernel_names_defined_in_a_module"] = sum(1 for n in names if n in defined)
        out["graph_kernel_ns_defined_in_a_module"] = sum(k[4] - k[3] for k in graph if k[6] in defined)
        out["graph_kernel_ns"] = sum(k[4] - k[3] for k in graph)
        out["other_names"] = sorted({n[:80] for n in names if n not in defined})[:30]
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--child", choices=("manual", "inductor"))
    a = ap.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    if a.child:
        d = manual() if a.child == "manual" else inductor()
        with gzip.open(out / f"graph_nodes-{a.child}.json.gz", "wt") as fh:
            json.dump(d, fh)
        print("SUMMARY " + json.dumps(summary(a.child, d)), flush=True)
        return 0
    rc = 0
    for case in ("manual", "inductor"):
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=f"/tmp/graph-nodes-inductor-{os.getpid()}-{case}")
        p = subprocess.run([sys.executable, __file__, "--out", str(out), "--child", case], capture_output=True,
                           text=True, timeout=400, env=env)
        print(p.stdout[-20000:], p.stderr[-4000:] if p.returncode else "", flush=True)
        rc |= p.returncode
    return rc


if __name__ == "__main__":
    sys.exit(main())
