"""Ground-truth attribution: the experiment (GPU, root) and its analysis (pure, tested on the CPU).

The experiment: tests/targets/gpu_ground_truth.py warms up, stacklens attaches by PID with
ProcessSession(agent=True), a primer of a few steps proves records flow, snapshot A, then exactly
K steps, snapshot B once the counts stop moving; the window is diff(B, A). After detach the target
profiles K calls of each function alone with torch.profiler (CPU+CUDA): the truth per kernel name
(count, summed duration). Stdlib + stacklens only here; torch lives in the target.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections import defaultdict
from pathlib import Path

TARGETS = Path(__file__).resolve().parents[1] / "targets"
if str(TARGETS) not in sys.path:
    sys.path.insert(0, str(TARGETS))

FUNCS = {"f": "gt_matmul_f", "g": "gt_conv_g"}
SPIN = "gt_spin"  # clock warm-up before each measured run: its kernels are set aside
TARGET_FILE = "gpu_ground_truth.py"
TOLERANCE = 0.02


def _is_mm(op: str) -> bool:
    return op.startswith(("aten::mm", "aten::addmm", "aten::matmul", "aten::linear", "aten::bmm"))


def _is_conv(op: str) -> bool:
    return "conv" in op


OP_CHECK = {"f": _is_mm, "g": _is_conv}
OP_EXPECT = {"f": "aten::mm (or addmm/matmul)", "g": "aten::convolution / aten::cudnn_convolution"}


def which_function(path) -> str | None:
    for fr in path:
        if fr.kind == "python" and fr.file.endswith(TARGET_FILE):
            for key, func in FUNCS.items():
                if fr.name == func:
                    return key
            if fr.name == SPIN:
                return "spin"
    return None


def per_function(snap) -> dict:
    """Per function: gpu_time_ns, kernel_count, launch_count, per kernel name, ops seen per kernel."""
    out: dict = {k: {"gpu_time_ns": 0, "kernel_count": 0, "launch_count": 0,
                     "kernels": defaultdict(lambda: {"count": 0, "gpu_time_ns": 0, "launch_count": 0}),
                     "kernel_paths": []} for k in list(FUNCS) + ["spin", "other"]}
    for path, excl in snap.iter_paths():
        key = which_function(path) or "other"
        d = out[key]
        copy_leaf = bool(path) and path[-1].kind in ("memcpy", "memset")  # the truth sums kernels only
        for m in ("gpu_time_ns", "kernel_count", "launch_count"):
            if not (copy_leaf and m == "gpu_time_ns"):
                d[m] += int(excl.get(m, 0) or 0)
        if path and path[-1].kind == "kernel":
            k = d["kernels"][path[-1].name]
            k["count"] += int(excl.get("kernel_count", 0) or 0)
            k["gpu_time_ns"] += int(excl.get("gpu_time_ns", 0) or 0)
            k["launch_count"] += int(excl.get("launch_count", 0) or 0)
            if excl.get("kernel_count"):
                d["kernel_paths"].append({"kernel": path[-1].name,
                                          "ops": [fr.name for fr in path if fr.kind == "op"],
                                          "kernel_count": int(excl.get("kernel_count", 0)),
                                          "gpu_time_ns": int(excl.get("gpu_time_ns", 0) or 0)})
    for d in out.values():
        d["kernels"] = {k: dict(v) for k, v in d["kernels"].items()}
    return out


def top_paths(snap, metric: str = "gpu_time_ns", k: int = 12) -> list[str]:
    rows = sorted(snap.iter_paths(), key=lambda pe: -(pe[1].get(metric, 0) or 0))[:k]
    return [f"{e.get(metric, 0)} {';'.join(f.label() for f in p)}"[:600] for p, e in rows]


def _short(name: str) -> str:
    """A comparable kernel name: CUPTI may give it mangled, torch.profiler demangled."""
    from stacklens.introspect.demangle import demangle

    n = demangle(name)
    return n.split("(")[0].split("<")[0].replace("void ", "").strip()


def compare_counts(seen: dict, truth: dict) -> list[str]:
    """Per-kernel-name counts: exact match by name (or by short name); else the multisets of counts."""
    problems = []
    s_left = {k: v["count"] for k, v in seen.items() if v["count"]}
    t_left = {k: v["count"] for k, v in truth.items()}
    for name in list(t_left):
        if name in s_left:
            if s_left[name] != t_left[name]:
                problems.append(f"{name[:120]}: stacklens {s_left[name]} vs torch.profiler {t_left[name]}")
            del s_left[name], t_left[name]
    by_short_s = defaultdict(int)
    for k, v in s_left.items():
        by_short_s[_short(k)] += v
    by_short_t = defaultdict(int)
    for k, v in t_left.items():
        by_short_t[_short(k)] += v
    for name in list(by_short_t):
        if name in by_short_s:
            if by_short_s[name] != by_short_t[name]:
                problems.append(f"{name[:120]}: stacklens {by_short_s[name]} vs torch.profiler {by_short_t[name]}")
            del by_short_s[name], by_short_t[name]
    if sorted(by_short_s.values()) != sorted(by_short_t.values()):
        problems.append(f"unmatched kernel names: stacklens {dict(by_short_s)} vs torch.profiler {dict(by_short_t)}")
    return problems


def analyze(snap, prof: dict[str, list[dict]], steps: int) -> dict:
    """Everything the tests assert, as data. prof: {"f": [prof answer, …], "g": [...]}."""
    view = per_function(snap)
    res: dict = {"steps": steps, "functions": {}, "other": {m: view["other"][m] for m in
                                                           ("gpu_time_ns", "kernel_count", "launch_count")}}
    for key in FUNCS:
        runs = prof.get(key) or []
        truth_ns = sum(r["total_ns"] for r in runs) / len(runs) if runs else 0
        truth_count = runs[0]["count"] if runs else 0
        d = view[key]
        bad_ops = [p for p in d["kernel_paths"] if not any(OP_CHECK[key](op) for op in p["ops"])]
        res["functions"][key] = {
            "func": FUNCS[key],
            "stacklens_gpu_time_ns": d["gpu_time_ns"], "truth_gpu_time_ns": truth_ns,
            "truth_runs_ns": [r["total_ns"] for r in runs],
            "rel_err": abs(d["gpu_time_ns"] - truth_ns) / truth_ns if truth_ns else None,
            "truth_noise": (max(r["total_ns"] for r in runs) - min(r["total_ns"] for r in runs)) / truth_ns
            if truth_ns and len(runs) > 1 else None,
            "stacklens_kernel_count": d["kernel_count"], "stacklens_launch_count": d["launch_count"],
            "truth_count": truth_count,
            "count_problems": compare_counts(d["kernels"], runs[0]["kernels"] if runs else {}),
            "kernels": d["kernels"], "truth_kernels": runs[0]["kernels"] if runs else {},
            "bad_op_paths": bad_ops[:10], "n_kernel_paths": len(d["kernel_paths"]),
            "ops_seen": sorted({op for p in d["kernel_paths"] for op in p["ops"]}),
        }
    f, g = res["functions"]["f"], res["functions"]["g"]
    if g["stacklens_gpu_time_ns"] and g["truth_gpu_time_ns"]:
        sl = f["stacklens_gpu_time_ns"] / g["stacklens_gpu_time_ns"]
        tr = f["truth_gpu_time_ns"] / g["truth_gpu_time_ns"]
        res["ratio"] = {"stacklens": sl, "truth": tr, "rel_err": abs(sl - tr) / tr}
    res["disjoint"] = not (set(f["truth_kernels"]) & set(g["truth_kernels"]))
    return res


# ---- the experiment (GPU machine, root) ---------------------------------------------------


def _counts(sess) -> tuple[int, int, int]:
    snap = sess.snapshot()
    tot = {m: (snap.total(m) if m not in snap.unavailable else 0) for m in ("kernel_count", "launch_count",
                                                                            "gpu_time_ns")}
    return tot["kernel_count"], tot["launch_count"], tot["gpu_time_ns"]


def wait_stable(sess, *, at_least_kernels: int = 1, quiet_s: float = 2.0, timeout_s: float = 25.0):
    """Snapshot once kernel and launch counts stop moving (CUPTI buffers arrive late)."""
    t_end = time.monotonic() + timeout_s
    last, since = None, time.monotonic()
    while time.monotonic() < t_end:
        c = _counts(sess)
        if c != last:
            last, since = c, time.monotonic()
        elif c[0] >= at_least_kernels and time.monotonic() - since >= quiet_s:
            break
        time.sleep(0.25)
    return sess.snapshot(), last


def run_experiment(steps: int = 100, warmup: int = 20, out_dir: str | None = None, *, agent: bool = True,
                   cpu_smoke: bool = False, threads: bool = False) -> dict:
    """The whole experiment; `agent=False, cpu_smoke=True` exercises the plumbing without a GPU.
    threads=True: each step runs f and g at once on two threads (their launches interleave)."""
    from gpu_control import Target

    from stacklens.cct import diff
    from stacklens.daemon.session import ProcessSession

    record: dict = {"steps": steps, "threads": threads}
    if out_dir:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
    err_log = os.path.join(out_dir, "ground_truth.stderr.log") if out_dir else None
    t = Target("gpu_ground_truth.py", ["--warmup", str(warmup)] + (["--cpu-smoke"] if cpu_smoke else [])
               + (["--threads"] if threads else []), stderr_path=err_log)
    try:
        record["target"] = t.info
        sess = ProcessSession(t.pid, agent=agent)
        need = 0 if cpu_smoke else 1
        t0 = time.monotonic()
        record["notes"] = [str(n) for n in sess.start()]
        record["attach_s"] = time.monotonic() - t0
        try:
            record["primer"] = t.cmd("go 3", timeout=120)
            snap_a, record["counts_a"] = wait_stable(sess, at_least_kernels=need)
            record["go"] = t.cmd(f"go {steps}", timeout=600)
            a_kernels = record["counts_a"][0] if record["counts_a"] else 0
            snap_b, record["counts_b"] = wait_stable(sess, at_least_kernels=a_kernels + need)
            record["stats"] = sess.stats()
        finally:
            sess.stop()
        window = diff(snap_b, snap_a)
        record["top_paths"] = top_paths(window)
        record["top_paths_launch"] = top_paths(window, "launch_count")
        if "py_samples" in window.metrics and "py_samples" not in window.unavailable:
            record["top_paths_py_samples"] = top_paths(window, "py_samples", 6)
        prof = {"f": [], "g": []}
        for _ in range(2):  # two runs each: their spread is the noise floor of the truth itself
            for key in ("f", "g"):
                prof[key].append(t.cmd(f"prof {steps} {key}", timeout=600))
        record["prof"] = prof
        record["analysis"] = analyze(window, prof, steps)
    finally:
        t.close()
        if out_dir:
            Path(out_dir).mkdir(parents=True, exist_ok=True)
            (Path(out_dir) / ("attribution_threads.json" if threads else "attribution.json")).write_text(json.dumps(record, indent=1, default=str))
    return record


# ---- verdicts (shared by the pytest tests and benchmarks/gpu/check_attribution.py) ---------


def context(rec: dict) -> str:
    return ("\nnotes: " + "; ".join(rec.get("notes", []))[:1500] + "\ncounts (kernels, launches, gpu ns) "
            f"before/after: {rec.get('counts_a')} / {rec.get('counts_b')}\nstats: {rec.get('stats')}\n"
            "top paths by gpu_time_ns:\n  " + "\n  ".join(rec.get("top_paths", [])[:8]))


def checks(rec: dict) -> dict[str, tuple[bool, str]]:
    """name → (passed, message). Each is one acceptance point of issue 9 (correctness)."""
    a = rec["analysis"]
    out: dict[str, tuple[bool, str]] = {}
    truth_ok = a["disjoint"] and all(a["functions"][k]["truth_count"] > 0 and
                                     a["functions"][k]["truth_gpu_time_ns"] > 0 for k in FUNCS)
    out["truth_is_sound"] = (truth_ok, f"disjoint={a['disjoint']}, truth counts "
                             f"{ {k: a['functions'][k]['truth_count'] for k in FUNCS} }")
    for key in FUNCS:
        fn = a["functions"][key]
        err = fn["rel_err"]
        out[f"gpu_time_{key}"] = (
            fn["stacklens_gpu_time_ns"] > 0 and err is not None and err <= TOLERANCE,
            f"{fn['func']}: stacklens {fn['stacklens_gpu_time_ns']} ns vs torch.profiler "
            f"{fn['truth_gpu_time_ns']:.0f} ns (runs {fn['truth_runs_ns']}, their spread "
            f"{fn['truth_noise']}): rel err {err}")
        want = fn["truth_count"]
        out[f"counts_{key}"] = (
            fn["stacklens_launch_count"] == want and fn["stacklens_kernel_count"] == want
            and not fn["count_problems"],
            f"{fn['func']}: launches seen {fn['stacklens_launch_count']}, kernels joined "
            f"{fn['stacklens_kernel_count']}, issued {want}; per kernel: {fn['count_problems'] or 'exact'}")
        out[f"operators_{key}"] = (
            fn["n_kernel_paths"] > 0 and not fn["bad_op_paths"],
            f"{fn['func']}: {fn['n_kernel_paths']} kernel paths, ops seen {fn['ops_seen'][:12]}; "
            f"without {OP_EXPECT[key]}: {fn['bad_op_paths'][:3]}")
    r = a.get("ratio")
    out["ratio"] = (bool(r) and r["rel_err"] <= TOLERANCE,
                    f"f/g: stacklens {r['stacklens']:.4f} vs truth {r['truth']:.4f} (rel err {r['rel_err']:.4f})"
                    if r else "no ratio: g has no GPU time")
    o = a["other"]
    out["nothing_elsewhere"] = (o["kernel_count"] == 0 and o["launch_count"] == 0,
                                f"outside f and g: {o}")
    return out
