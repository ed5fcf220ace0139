"""After detach, the process as it was (issue 20, acceptance 2), on the GPU machine in one call.

    bash benchmarks/gpu/check_detach.sh        (the device: carry [".device"]; results under $OUT)
    python benchmarks/gpu/check_detach.py --out DIR [--workloads launch,decode]
        [--variants finalize,no_finalize,control] [--steps N] [--pin-target 4-7 --pin-bench 8-15]
        [--deadline-s 540] [--cpu-smoke]

Per workload and variant, ONE fresh target process (CUPTI's state is per process; the target is
this file run with ``--target WORKLOAD``), phases in this order:
  1. unprofiled: N steps
  2. attach #1 by PID (probes + agent, ProcessSession), N steps, detach; the agent's teardown note
  3. after detach: N steps at once and N steps 2 s later (acceptance 2: <= 1.02x of 1)
  4. CUDA graphs: one captured before attach #1 and one captured now, each replayed on new
     inputs and checked against the same computation run eagerly
  5. attach #2: N steps, its kernels counted (a second attach works), detach; N steps after
  6. torch.profiler over 100 add_ kernels and over a few steps of the workload: every kernel?
  7. N steps after torch.profiler; attach #3 (Kineto now keeps CUPTI's subscriber: the note
     says finalize was skipped), detach
Variants: finalize (the default agent), no_finalize (gpu_finalize=False: CUPTI's hooks stay),
control (the same phases, never attached: how much the phases move on their own).
Workloads: launch (1,000 add_ per step), decode (batch-1 greedy decoding of 48 tokens with a
GPT-2-shaped model, random weights: transformers' GPT2LMHeadModel, else a built-in equivalent).
Writes DIR/check_detach.json (everything), DIR/check_detach.md (the tables) and DIR/targets.log
(the targets' stderr); exit 0 iff every check passed. Needs root (BPF), stacklens importable,
torch with CUDA and cupti-python in the target. ``--target`` needs no stacklens.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import threading
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests" / "targets"))

WORKLOADS = ("launch", "decode")
VARIANTS = {"finalize": {}, "no_finalize": {"gpu_finalize": False}, "control": None}
STEPS = {"launch": 150, "decode": 10}      # ~1-2 s per unprofiled phase on the H200
PROFILED_STEPS = {"launch": 10, "decode": 3}   # under torch.profiler: 10k / ~5k kernel events
SEQ_KERNELS = 100                          # torch.profiler's known sequence: 100 add_, one kernel each
MAX_AFTER = 1.02                           # acceptance 2
TEARDOWN_WORDS = ("cupti finalized", "CUPTI finalize skipped", "CUPTI left initialised")
T0 = time.monotonic()


def log(msg: str) -> None:
    ts = datetime.datetime.now().strftime("%H:%M:%S")
    print(f"[{ts} +{time.monotonic() - T0:6.1f}s] {msg}", flush=True)


def err_text(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"[:1500]


# ---- the target (--target WORKLOAD) -----------------------------------------------------------


def build_launch(torch, dev, smoke):
    n = 100 if smoke else 1000
    t = torch.zeros(16, device=dev)

    def step():
        for _ in range(n):
            t.add_(1.0)
    return step, f"launch-bound loop: {n} x add_ on a 16-element tensor", n


def build_decode(torch, dev, smoke):
    """Batch-1 greedy decoding, 48 new tokens after a 32-token prompt, GPT-2 small's shape
    (--cpu-smoke: 2 x 64, 4 tokens, the built-in model)."""
    new, vocab, width, depth = (4, 512, 64, 2) if smoke else (48, 50257, 768, 12)
    ids = torch.randint(0, vocab, (1, 32), device=dev)
    try:
        from transformers import GPT2Config, GPT2LMHeadModel
    except ImportError:
        GPT2LMHeadModel = None
    if GPT2LMHeadModel is not None and not smoke:
        model = GPT2LMHeadModel(GPT2Config()).to(dev).eval()

        def step():
            with torch.no_grad():
                model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                               pad_token_id=0, attention_mask=torch.ones_like(ids))
        return step, "transformers GPT2LMHeadModel (12 x 768, random weights), generate 48 tokens, KV cache", None
    nn = torch.nn
    layer = nn.TransformerEncoderLayer(width, width // 64, 4 * width, dropout=0.0, batch_first=True,
                                       norm_first=True)
    body = nn.TransformerEncoder(layer, depth, enable_nested_tensor=False).to(dev).eval()
    emb, pos = nn.Embedding(vocab, width).to(dev), nn.Embedding(1024, width).to(dev)
    head = nn.Linear(width, vocab).to(dev)

    def step():
        seq = ids
        with torch.no_grad():
            for _ in range(new):
                n = seq.shape[1]
                mask = nn.Transformer.generate_square_subsequent_mask(n, device=dev)
                h = body(emb(seq) + pos(torch.arange(n, device=dev)), mask=mask, is_causal=True)
                seq = torch.cat([seq, head(h[:, -1]).argmax(-1, keepdim=True)], dim=1)
    return step, f"built-in GPT-2-shaped decoder ({depth} x {width}, random weights), {new} tokens, no KV cache", None


class Graph:
    """A captured CUDA graph (relu(w @ x) + 1) and its check: replayed on new inputs, against
    the same computation run eagerly."""

    def __init__(self, torch):
        self.torch = torch
        self.x = torch.randn(1024, device="cuda")
        self.w = torch.randn(1024, 1024, device="cuda")
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):          # warm-up off the capture, as torch.cuda.graph asks
            for _ in range(3):
                torch.relu(self.w @ self.x) + 1
        torch.cuda.current_stream().wait_stream(s)
        self.g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.g):
            self.y = torch.relu(self.w @ self.x) + 1
        torch.cuda.synchronize()

    def check(self, n: int = 10) -> bool:
        torch = self.torch
        ok = True
        for _ in range(n):
            self.x.copy_(torch.randn_like(self.x))
            self.g.replay()
            torch.cuda.synchronize()
            ok = ok and bool(torch.allclose(self.y, torch.relu(self.w @ self.x) + 1, rtol=1e-3, atol=1e-3))
        return ok


def trace_kernels(prof) -> int:
    """Kernel events in torch.profiler's exported trace (the count gpu_workloads.py uses)."""
    import tempfile

    fd, path = tempfile.mkstemp(prefix="stacklens-detach-", suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        blob = Path(path).read_bytes()
        return blob.count(b'"cat": "kernel"') + blob.count(b'"cat":"kernel"')
    finally:
        os.unlink(path)


def target(workload: str, smoke: bool) -> int:
    from gpu_control import pin_self_from_env, stdin_lines

    pinned = pin_self_from_env()            # before torch starts threads
    import torch
    from torch.profiler import ProfilerActivity, profile

    dev = "cpu" if smoke else "cuda"
    sync = (lambda: None) if smoke else torch.cuda.synchronize
    acts = [ProfilerActivity.CPU] + ([] if smoke else [ProfilerActivity.CUDA])
    step, impl, per_step = {"launch": build_launch, "decode": build_decode}[workload](torch, dev, smoke)
    for _ in range(3):
        step()
    sync()
    before = None if smoke else Graph(torch)   # captured before any attach: replayed after each teardown
    say = lambda obj: print(json.dumps(obj), flush=True)  # noqa: E731
    info = {"workload": workload, "impl": impl, "kernels_per_step": per_step, "pid": os.getpid(),
                 "torch": torch.__version__, "cuda": torch.version.cuda,
                 "gpu": None if smoke else torch.cuda.get_device_name(0), "pinned": pinned}
    print("ready " + json.dumps(info), flush=True)

    def run(n: int) -> list[float]:
        times = []
        for _ in range(n):
            t = time.perf_counter()
            step()
            sync()
            times.append(time.perf_counter() - t)
        return times

    for line in stdin_lines():
        parts = line.split()
        if not parts:
            continue
        try:
            if parts[0] == "quit":
                break
            if parts[0] == "run":
                times = run(int(parts[1]))
                say({"cmd": "run", "median_s": statistics.median(times), "step_s": [round(t, 7) for t in times]})
            elif parts[0] == "graph":
                if smoke:
                    say({"cmd": "graph", "error": "n/a on the CPU"})
                    continue
                say({"cmd": "graph", "captured_before": before.check(), "captured_now": Graph(torch).check()})
            elif parts[0] == "torchprof":
                n = int(parts[1])
                x = torch.zeros(16, device=dev)
                sync()
                with profile(activities=acts) as prof:
                    for _ in range(SEQ_KERNELS):
                        x.add_(1.0)
                    sync()
                seq = trace_kernels(prof)
                with profile(activities=acts) as prof:
                    times = run(n)
                say({"cmd": "torchprof", "seq_kernels": seq, "seq_expected": SEQ_KERNELS,
                     "step_kernels": trace_kernels(prof), "step_expected": per_step * n if per_step else None,
                     "median_s": statistics.median(times)})
            else:
                say({"cmd": parts[0], "error": f"unknown command {parts[0]!r}"})
        except Exception as e:  # noqa: BLE001 — answer, keep serving
            say({"cmd": parts[0], "error": err_text(e), "trace": traceback.format_exc()[-2000:]})
    return 0


# ---- the driver ---------------------------------------------------------------------------------


def teeing_agent(seen: dict):
    """The session's agent factory, its records teed: every agent note and the last GPU stats
    land in ``seen`` (the snapshot keeps 32 notes; the teardown's comes last, at detach)."""
    from stacklens.daemon.session import default_agent_factory
    from stacklens.records.agent import AgentStats, Note

    def factory(pid, **kw):
        link = default_agent_factory(pid, **kw)
        poll = link.poll

        def teed(max_n=None):
            recs = poll(max_n)
            for r in recs:
                if isinstance(r, Note):
                    seen["notes"].append(f"{r.level}: {r.message}"[:300])
                elif isinstance(r, AgentStats):
                    seen["gpu_stats"] = dict(r.gpu)
            return recs
        link.poll = teed
        return link
    return factory


def attach_run(t, n: int, agent_config: dict, timeout_s: float) -> dict:
    """Attach probes + agent, n steps, detach: attach/detach times, the kernels the session joined,
    the agent's notes (its teardown's among them, sent at detach) and its last GPU stats."""
    from stacklens.daemon.session import ProcessSession

    seen: dict = {"notes": [], "gpu_stats": {}}
    sess = ProcessSession(t.pid, agent=True, agent_config=agent_config, agent_factory=teeing_agent(seen))
    box: dict = {}

    def go():
        try:
            box["notes"] = sess.start()
        except BaseException as e:  # noqa: BLE001
            box["error"] = e

    t0 = time.monotonic()
    th = threading.Thread(target=go, daemon=True)
    th.start()
    th.join(timeout_s)
    if th.is_alive():
        raise TimeoutError(f"ProcessSession.start() did not return within {timeout_s:.0f}s")
    if "error" in box:
        raise box["error"]
    r: dict = {"attach_s": round(time.monotonic() - t0, 3)}
    try:
        r["run"] = t.cmd(f"run {n}", timeout=timeout_s)
        time.sleep(0.3)                    # the last records on their way
    finally:
        t1 = time.monotonic()
        sess.stop()
        r["detach_s"] = round(time.monotonic() - t1, 3)
    snap = sess.snapshot()                 # after stop(): the final tree
    r["kernels"] = snap.total("kernel_count") if "kernel_count" not in snap.unavailable else None
    r["notes"] = seen["notes"][-16:]
    r["gpu_stats"] = seen["gpu_stats"]
    r["teardown"] = next((x for x in seen["notes"] if any(w in x for w in TEARDOWN_WORDS)), None)
    return r


def one_process(workload: str, variant: str, a, out: Path) -> dict:
    from gpu_control import PIN_ENV, Target

    cfg = VARIANTS[variant]
    n = a.steps or STEPS[workload]
    rec: dict = {"workload": workload, "variant": variant, "steps": n, "phases": {}}
    ph = rec["phases"]
    env = {PIN_ENV: a.pin_target} if a.pin_target else None
    t = Target(str(Path(__file__).resolve()), ["--target", workload] + (["--cpu-smoke"] if a.cpu_smoke else []),
               env=env, stderr_path=out / "targets.log", ready_timeout=300)
    rec["target"] = t.info
    timeout = 300.0

    def phase(key: str, fn) -> None:
        if time.monotonic() - T0 > a.deadline_s:
            ph[key] = {"status": "skipped: deadline"}
            return
        t0 = time.monotonic()
        try:
            r = fn()
            r.setdefault("status", "ok")
        except Exception as e:  # noqa: BLE001 — recorded, the next phase still runs
            r = {"status": f"failed: {err_text(e)}", "trace": traceback.format_exc()[-2000:]}
        r["wall_s"] = round(time.monotonic() - t0, 2)
        ph[key] = r
        med = r.get("median_s") or r.get("run", {}).get("median_s")
        log(f"{workload}/{variant}/{key}: {f'median {med * 1e3:.3f} ms' if med else ''} "
            f"{r.get('teardown') or ''} {r['status'] if r['status'] != 'ok' else ''}".rstrip())

    def plain():
        return t.cmd(f"run {n}", timeout=timeout)

    def attached():
        if cfg is None:                    # control: the same steps, never attached
            return {"run": t.cmd(f"run {n}", timeout=timeout)}
        return attach_run(t, n, cfg, timeout)

    def later():
        time.sleep(2.0)
        return plain()

    try:
        phase("unprofiled", plain)
        phase("attach1", attached)
        phase("after1", plain)
        phase("after1_2s", later)
        phase("graph", lambda: t.cmd("graph", timeout=timeout))
        phase("attach2", attached)
        phase("after2", plain)
        phase("torchprof", lambda: t.cmd(f"torchprof {PROFILED_STEPS[workload]}", timeout=timeout))
        phase("after_torchprof", plain)
        phase("attach3", attached)
        phase("graph_end", lambda: t.cmd("graph", timeout=timeout))
    finally:
        rec["exit"] = t.close()
    return rec


def median_of(ph: dict, key: str) -> float | None:
    r = ph.get(key) or {}
    return r.get("median_s") or (r.get("run") or {}).get("median_s")


def evaluate(rec: dict) -> list[dict]:
    """The checks of one process's record: [{"check", "pass", "value"}]. Acceptance 2 is asked of
    the finalize variant; the others show what it is against (their speed after detach is recorded,
    not checked)."""
    ph, variant = rec["phases"], rec["variant"]
    base = median_of(ph, "unprofiled")
    out: list[dict] = []

    def check(name: str, ok: bool, value) -> None:
        out.append({"check": name, "pass": bool(ok), "value": value})

    ratios = {k: round(median_of(ph, k) / base, 4) if base and median_of(ph, k) else None
              for k in ("attach1", "after1", "after1_2s", "after2", "after_torchprof")}
    rec["ratios"] = ratios
    if variant == "finalize":
        for k in ("after1", "after2"):
            check(f"{k} <= {MAX_AFTER}x unprofiled", ratios[k] is not None and ratios[k] <= MAX_AFTER, ratios[k])
        for k in ("attach1", "attach2"):
            td = (ph.get(k) or {}).get("teardown") or ""
            check(f"{k}: cupti finalized", "cupti finalized" in td, td)
        td = (ph.get("attach3") or {}).get("teardown") or ""
        check("attach3 (after torch.profiler): finalize skipped, CUPTI left alone",
              "CUPTI finalize skipped" in td, td)
    if variant != "control":
        k2 = (ph.get("attach2") or {}).get("kernels")
        check("attach2: a second attach records kernels", bool(k2), k2)
    tp = ph.get("torchprof") or {}
    check("torch.profiler after detach: every kernel of the known sequence",
          tp.get("seq_expected") is not None and tp.get("seq_kernels") == tp["seq_expected"],
          [tp.get("seq_kernels"), tp.get("seq_expected")])
    if tp.get("step_expected"):
        check("torch.profiler after detach: every kernel of the workload's steps",
              tp.get("step_kernels") == tp["step_expected"], [tp.get("step_kernels"), tp["step_expected"]])
    for k in ("graph", "graph_end"):
        g = ph.get(k) or {}
        check(f"{k}: CUDA graphs replay (captured before attach, and after)",
              g.get("captured_before") is True and g.get("captured_now") is True,
              [g.get("captured_before"), g.get("captured_now")])
    return out


def markdown(results: list[dict]) -> str:
    lines = ["| workload | variant | unprofiled ms | attached | after detach | after 2 s | after 2nd detach | "
             "after torch.profiler | teardown #1 | failed checks |", "|---|---|---|---|---|---|---|---|---|---|"]
    for rec in results:
        r, ph = rec.get("ratios", {}), rec.get("phases", {})
        base = median_of(ph, "unprofiled")
        td = ((ph.get("attach1") or {}).get("teardown") or "")[:60]
        bad = [c["check"] for c in rec.get("checks", []) if not c["pass"]]
        cells = [rec["workload"], rec["variant"], f"{base * 1e3:.3f}" if base else "-"]
        cells += [f"{r[k]:.3f}x" if r.get(k) else "-" for k in ("attach1", "after1", "after1_2s", "after2", "after_torchprof")]
        cells += [td or "-", "; ".join(bad) or "none"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def environment() -> dict:
    import platform
    import subprocess

    env = {"python": sys.version.split()[0], "kernel": platform.release(), "argv": sys.argv}
    try:
        env["commit"] = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
                                       capture_output=True, text=True, timeout=10).stdout.strip()
        env["nvidia_smi"] = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                                           capture_output=True, text=True, timeout=20).stdout.strip()
    except (OSError, subprocess.SubprocessError) as e:
        env["env_error"] = err_text(e)
    return env


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="results folder")
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--steps", type=int, default=0, help="steps per phase (default: per workload)")
    ap.add_argument("--pin-target", default=None, help="CPU list each target pins itself to, e.g. 4-7")
    ap.add_argument("--pin-bench", default=None, help="CPU list for this process, e.g. 8-15")
    ap.add_argument("--deadline-s", type=float, default=540.0, help="phases after this are skipped")
    ap.add_argument("--cpu-smoke", action="store_true",
                    help="tiny sizes on the CPU: the harness without a GPU (the GPU checks fail)")
    ap.add_argument("--target", choices=WORKLOADS, help=argparse.SUPPRESS)   # the target process
    a = ap.parse_args(argv)
    if a.target:
        return target(a.target, a.cpu_smoke)
    if not a.out:
        ap.error("--out is required")
    for spec, opt in ((a.workloads, WORKLOADS), (a.variants, VARIANTS)):
        bad = set(spec.split(",")) - set(opt)
        if bad:
            ap.error(f"unknown {sorted(bad)}: one of {', '.join(opt)}")
    if a.pin_bench:
        from gpu_control import cpu_list
        os.sched_setaffinity(0, cpu_list(a.pin_bench))
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    doc = {"environment": environment(), "results": []}
    for w in a.workloads.split(","):
        for v in a.variants.split(","):
            log(f"{w}/{v}: a fresh target")
            try:
                rec = one_process(w, v, a, out)
                rec["checks"] = evaluate(rec)
            except Exception as e:  # noqa: BLE001 — the next process still runs
                rec = {"workload": w, "variant": v, "status": f"failed: {err_text(e)}", "phases": {},
                       "checks": [{"check": "target ran", "pass": False, "value": err_text(e)}]}
            doc["results"].append(rec)
            (out / "check_detach.json").write_text(json.dumps(doc, indent=1))
            (out / "check_detach.md").write_text(markdown(doc["results"]))
    doc["ok"] = all(c["pass"] for rec in doc["results"] for c in rec["checks"])
    (out / "check_detach.json").write_text(json.dumps(doc, indent=1))
    print(markdown(doc["results"]), flush=True)
    log(f"all checks passed: {doc['ok']}")
    return 0 if doc["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
