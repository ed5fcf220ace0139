"""Issue 10, acceptance 1 and 2: stacklens' GPU time per JAX source line vs jax.profiler's (same HLO
maps), and a recompilation's compile time on its call site.

    python benchmarks/gpu/check_jax.py --out DIR [--seconds 6] [--profile-steps 50] [--tolerance 0.05]
                                       [--command-buffer off|on]
    python benchmarks/gpu/check_jax.py --out DIR --cpu        # smoke mode on a machine without GPU

One target process (this file with --target) runs a jitted training step — a dense layer and an
attention block in separate functions — in a loop, and obeys commands on stdin. Phases:
  1. attach the agent by PID (AgentServer + inject_agent: root/ptrace); once its HLO map of the
     train step has arrived (the jax.monitoring listener is then registered), the target is told to
     run the step once with a new input shape (`grow`, from the line marked GROW: a recompilation);
     then the agent collects for --seconds (CUPTI kernel records, HLO maps, compile events); detach.
     Each kernel that started after the recompilation goes through stacklens.daemon.join.jaxjoin.JaxIndex
     (the daemon's rule: name match, CUDA graph → its module, launch order for library kernels, even
     split over the fused operators).
  2. the target runs --profile-steps steps under jax.profiler.trace (the agent is gone: CUPTI has
     one subscriber at a time); every device kernel event is mapped through the SAME HLO maps
     (`map_profiler`): by its hlo_module/hlo_op stats (per HLO instruction, independent of
     stacklens' name matching) when the trace's hlo_op stats are per kernel — checked on the events
     whose kernel is named after an instruction: >= 90% of them must carry that instruction as
     hlo_op (GPU run 7, JAX 0.11.2: all of the profiler's time landed on the DENSE line by hlo_op
     while the totals agreed — its hlo_op stats named dense instructions for every kernel);
     else, and for an event whose hlo_op is no instruction of the map (an XLA command buffer,
     `command_buffer_1`), by its kernel name (the xplane event name) resolved the way stacklens
     does. `profiler_mapping` / `profiler_side` in the JSON count events per way and per
     module/instruction kind, the agreement, the distinct hlo_ops and the per-line time by hlo_op.
  3. per source line: GPU ms per step on both sides, relative difference; PASS iff every line holding
     >= 1% of the profiler's time agrees within --tolerance. Steps seen by stacklens: for every
     kernel name the profiler sees a whole number of times per step, stacklens' count of it / that
     per-step count; the median (`step_estimates` in the JSON: min/median/max, and the target's own
     step counter over the window as a cross-check).
  4. recompilation (issue 10 point 2): a compile event with the `grow` call site (this file, GROW
     line) as the innermost frame, backend compile included, charged there as compile_time_ns.
--command-buffer off (default): the target runs with XLA_FLAGS+=--xla_gpu_enable_command_buffer=
(empty: no XLA command buffers / CUDA graphs), so the profiler's events carry per-instruction hlo_op
stats; `on` leaves XLA's default (the step runs as CUDA graphs: stacklens sees graph_id != 0 kernels,
the profiler side maps by kernel name).
--cpu: no CUPTI here, so the stacklens side is fed the profiler's CPU thunk events renamed the way
XLA:GPU names kernels (sanitized instruction names): it checks the plumbing (attach, HLO maps,
name matching, split, recompile call site, the GPU-needed note), not GPU timing.
Writes DIR/check_jax.json and nothing else (trace, agent socket, target stderr: a work folder
removed at the end, kept with --keep; the target's stderr tail goes into the JSON on an error);
exit 0 iff PASS. Needs root (ptrace) and jax; on the GPU machine jax
with CUDA and cupti-python.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import glob
import json
import os
import queue
import select
import statistics
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
NO_COMMAND_BUFFER = "--xla_gpu_enable_command_buffer="


def _importable_stacklens() -> None:
    """The repo root is the package `stacklens`: make it importable through a symlink if needed."""
    try:
        import stacklens  # noqa: F401
        return
    except ImportError:
        pass
    d = tempfile.mkdtemp(prefix="stacklens-path.")
    os.symlink(REPO, os.path.join(d, "stacklens"))
    sys.path.insert(0, d)
    os.environ["PYTHONPATH"] = d + (os.pathsep + os.environ["PYTHONPATH"] if os.environ.get("PYTHONPATH") else "")


def marker_line(marker: str) -> int:
    for i, line in enumerate(Path(__file__).read_text().splitlines(), 1):
        if line.rstrip().endswith("# " + marker):
            return i
    raise LookupError(marker)


# ---- the target -----------------------------------------------------------------------------------

def dense(x, w, b):
    import jax
    return jax.nn.gelu(x @ w + b)  # DENSE


def attention(h, wq, wk, wv, heads):
    import jax
    import jax.numpy as jnp
    t, d = h.shape[-2], h.shape[-1]
    q = (h @ wq).reshape(-1, t, heads, d // heads)  # ATTN_Q
    k = (h @ wk).reshape(-1, t, heads, d // heads)  # ATTN_K
    v = (h @ wv).reshape(-1, t, heads, d // heads)  # ATTN_V
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(jnp.float32(d // heads)).astype(h.dtype)  # ATTN_SCORES
    p = jax.nn.softmax(s, axis=-1)  # ATTN_SOFTMAX
    return jnp.einsum("bhqk,bkhd->bqhd", p, v).reshape(h.shape)  # ATTN_OUT


def build_step(B: int, T: int, D: int, H: int):
    """(jitted train step, params, input) — the target's workload (also used by the tests)."""
    import jax
    import jax.numpy as jnp

    dt = jnp.float32
    ks = jax.random.split(jax.random.PRNGKey(0), 6)
    params = {"w": jax.random.normal(ks[0], (D, D), dt) / D ** 0.5, "b": jnp.zeros((D,), dt),
              "wq": jax.random.normal(ks[1], (D, D), dt) / D ** 0.5, "wk": jax.random.normal(ks[2], (D, D), dt) / D ** 0.5,
              "wv": jax.random.normal(ks[3], (D, D), dt) / D ** 0.5}
    x = jax.random.normal(ks[4], (B, T, D), dt)

    def loss(p, x):
        h = dense(x, p["w"], p["b"])
        return jnp.mean(attention(h, p["wq"], p["wk"], p["wv"], H) ** 2)

    @jax.jit
    def train_step(p, x):
        l, g = jax.value_and_grad(loss)(p, x)
        return jax.tree_util.tree_map(lambda w, gw: w - 1e-3 * gw, p, g), l

    return train_step, params, x


def target_main(a) -> None:
    import jax

    T = a.seq
    train_step, params, x = build_step(a.batch, a.seq, a.d, a.heads)
    x_grow = x[:, : max(1, T // 2)]          # made now: `grow` compiles nothing but the new train step
    x_grow.block_until_ready()
    params, l = train_step(params, x)
    l.block_until_ready()
    cmds: queue.Queue = queue.Queue()

    def reader():
        for line in sys.stdin:
            cmds.put(line.split())
        cmds.put(["quit"])

    threading.Thread(target=reader, daemon=True).start()
    print("ready", jax.default_backend(), flush=True)
    steps = 0
    while True:
        try:
            cmd = cmds.get_nowait()
        except queue.Empty:
            cmd = None
        if cmd:
            if cmd[0] == "quit":
                break
            if cmd[0] == "count":
                print("count", steps, time.monotonic_ns(), flush=True)
            elif cmd[0] == "grow":
                t0 = time.monotonic_ns()
                _p, lg = train_step(params, x_grow)  # GROW
                lg.block_until_ready()
                print("grown", t0, time.monotonic_ns(), flush=True)
            elif cmd[0] == "profile":
                n, d = int(cmd[1]), cmd[2]
                with jax.profiler.trace(d):
                    for _ in range(n):
                        params, l = train_step(params, x)
                    l.block_until_ready()
                print("profiled", n, flush=True)
        params, l = train_step(params, x)  # STEP
        l.block_until_ready()
        steps += 1
    print("steps", steps, flush=True)


# ---- the check ------------------------------------------------------------------------------------

def _readline(proc, timeout_s: float) -> str:
    r, _, _ = select.select([proc.stdout], [], [], timeout_s)
    if not r:
        raise TimeoutError(f"target said nothing for {timeout_s:.0f}s")
    line = proc.stdout.readline()
    if not line:
        err = Path(proc.err_path).read_text(errors="replace")[-3000:] if getattr(proc, "err_path", None) else ""
        raise RuntimeError(f"target exited: rc={proc.wait()} stderr={err}")
    return line.strip()


def _expect(proc, word: str, timeout_s: float) -> list[str]:
    end = time.monotonic() + timeout_s
    while True:
        line = _readline(proc, max(0.1, end - time.monotonic()))
        if line.split()[:1] == [word]:
            return line.split()


def _command(proc, cmd: str, reply: str, timeout_s: float) -> list[str]:
    proc.stdin.write(cmd + "\n")
    proc.stdin.flush()
    return _expect(proc, reply, timeout_s)


def _site(frames) -> str:
    return f"{Path(frames[-1][0]).name}:{frames[-1][2]}" if frames else ""


def _line_key(file=None, line=0, func=None, op_name=None) -> str:
    """A per-line row's key: `file:line (function)`, else `[operator]`, else `[no operator]`."""
    if file:
        return f"{Path(file).name}:{line} ({func})"
    return f"[{op_name}]" if op_name is not None else "[no operator]"


def _charge(acc: dict, ops, ns: float) -> None:
    """The daemon's rule (jaxjoin.split_paths): even split over the distinct operators."""
    if not ops:
        acc[_line_key()] += ns
        return
    for op_name, file, line, func in ops:
        acc[_line_key(file, line, func, op_name)] += ns / len(ops)


def _index(recs):
    """A JaxIndex fed these HLO map records."""
    from stacklens.daemon.join.jaxjoin import JaxIndex
    index = JaxIndex()
    for r in recs:
        index.add_hlo(r)
    return index


def _launch_order(kernels) -> list:
    """Kernel records by (device, stream, start): the order the daemon's index sees them in."""
    return sorted(kernels, key=lambda k: (k.device, k.stream, k.start_ns))


ProfEvent = collections.namedtuple("ProfEvent", "module hlo_op name stream start_ns dur_ns graph_id")


def profiler_events(log_dir: str, cpu: bool) -> tuple[list[ProfEvent], dict]:
    """Every kernel (GPU) / thunk (CPU) event of the trace, and what the xplane looked like (for
    debugging on a new jax version)."""
    from jax.profiler import ProfileData

    paths = sorted(glob.glob(os.path.join(log_dir, "**", "*.xplane.pb"), recursive=True))
    if not paths:
        raise RuntimeError(f"jax.profiler wrote no .xplane.pb under {log_dir}")
    pd = ProfileData.from_file(paths[-1])
    out, shape = [], {"file": Path(paths[-1]).name, "planes": {}}
    skip_lines = ("XLA Ops", "XLA Modules", "Steps", "Framework Ops", "Source code", "XLA TraceMe",
                  "Framework Name Scope", "TensorFlow Name Scope", "TensorFlow Ops")
    streams: dict = {}
    for plane in pd.planes:
        dev = plane.name.startswith("/device:GPU") or plane.name.startswith("/device:ROCM")
        if not (dev or (cpu and plane.name == "/host:CPU")):
            continue
        lines = shape["planes"].setdefault(plane.name, {})
        for line in plane.lines:
            n = 0
            if line.name in skip_lines:
                lines[line.name] = "skipped"
                continue
            stream = streams.setdefault((plane.name, line.name), len(streams) + 1)
            for e in line.events:
                with warnings.catch_warnings():      # "builtin type event_stats has no __module__"
                    warnings.simplefilter("ignore", DeprecationWarning)
                    st = dict(e.stats)
                if "hlo_op" not in st or "memcpy_details" in st or "memset_details" in st:
                    continue
                if dev and "kernel_details" not in st and "correlation_id" not in st:
                    continue
                try:
                    graph = int(st.get("cuda_graph_id", 0) or 0)
                except (TypeError, ValueError):
                    graph = 0
                out.append(ProfEvent(str(st.get("hlo_module", "")), str(st["hlo_op"]), str(e.name), stream,
                                     int(e.start_ns), float(e.duration_ns), graph))
                n += 1
                if n == 1:
                    lines[line.name + " (first event stats)"] = {k: str(v)[:200] for k, v in st.items()}
                    lines[line.name + " (first event name)"] = str(e.name)[:300]
            lines[line.name] = n
    return out, shape


def _module_choice(events: list[ProfEvent], index) -> dict:
    """hlo_module name -> the map its events' hlo_op stats are looked up in (JaxIndex.module_named:
    the module of that name holding most of the distinct hlo_ops the trace shows for it)."""
    seen: dict = collections.defaultdict(set)
    for ev in events:
        seen[ev.module].add(ev.hlo_op)
    chosen = {name: index.module_named(name, ops) for name, ops in seen.items()}
    return {name: m for name, m in chosen.items() if m is not None}


HLO_OP_AGREEMENT = 0.9   # below: the trace's hlo_op stats do not say which instruction ran each kernel


def map_profiler(events: list[ProfEvent], pindex, sanitize, steps: int,
                 diag: dict | None = None) -> tuple[dict, dict, dict]:
    """Profiler events -> (ns per step per source line, events per mapping way, unknown ns).

    Every event is looked at two ways: (a) its hlo_module/hlo_op stats name an instruction of the
    map (`_module_choice`, in pindex's maps), independent of stacklens' name matching; (b) its
    kernel name resolved as stacklens does, by `pindex` (a JaxIndex of its own, fed every event in
    stream order so its launch-order state is right). (a) is used (way `hlo_op`) when the trace's
    hlo_op stats are per kernel: on the events whose kernel is named after an instruction (way (b)
    by rule `name`), at least HLO_OP_AGREEMENT of them name that same instruction. Else — or for an event whose hlo_op
    is no instruction of the map (an XLA command buffer, `command_buffer_1`) — (b) (ways
    `kernel_name:name` / `kernel_name:order`); else `unknown`. `diag` (if given) receives the
    basis, the agreement, the events per module/instruction kind and the distinct hlo_ops."""
    chosen = _module_choice(events, pindex)
    rows = []
    agree = checked = order_agree = order_checked = 0
    mismatches = collections.Counter()
    for ev in sorted(events, key=lambda e: (e.stream, e.start_ns)):
        by_name = pindex.resolve(sanitize(ev.name), 0, ev.stream, ev.graph_id)
        m = chosen.get(ev.module)
        by_op = (m, m.by_instr[ev.hlo_op]) if m is not None and ev.hlo_op in m.by_instr else None
        if by_op is not None and by_name is not None:
            nm, idxs, rule = by_name
            names = {sanitize(nm.entries[i][0]) for i in idxs}
            same = sanitize(ev.hlo_op) in names
            if rule == "name":
                checked += 1
                agree += same
                if not same:
                    mismatches[f"{ev.name[:60]} -> hlo_op {ev.hlo_op}"] += 1
            else:
                order_checked += 1
                order_agree += same
        rows.append((ev, by_op, by_name))
    reliable = checked == 0 or agree >= HLO_OP_AGREEMENT * checked
    prof: dict = collections.defaultdict(float)
    by_hlo_op: dict = collections.defaultdict(float)
    ways = collections.Counter()
    kinds = collections.Counter()
    unknown = collections.Counter()
    for ev, by_op, by_name in rows:
        ns = ev.dur_ns / steps
        if by_op is not None:
            _charge(by_hlo_op, by_op[0].entries[by_op[1]][2], ns)
        if by_op is not None and (reliable or by_name is None):
            m, i = by_op
            ops = m.entries[i][2]
            ways["hlo_op"] += 1
            kinds[f"{m.name}/{m.entries[i][1]} (hlo_op)"] += 1
        elif by_name is not None:
            m, idxs, rule = by_name
            ops = m.operators(idxs)
            ways["kernel_name:" + rule] += 1
            kinds[f"{m.name}/{m.entries[idxs[0]][1]} (kernel name: {rule})"] += 1
        else:
            ways["unknown"] += 1
            kinds[f"{ev.module or '?'}/? (unknown)"] += 1
            unknown[f"{ev.module}/{ev.hlo_op} ({ev.name[:80]})"] += ev.dur_ns
            ops = ()
        _charge(prof, ops, ns)
    if diag is not None:
        hlo_ops = collections.Counter(ev.hlo_op for ev in events)
        diag.update({
            "basis": "hlo_op" if reliable else "kernel_name",
            "hlo_op_agrees_with_kernel_name": {"agree": agree, "checked": checked,
                                               "library_kernels_agree": order_agree,
                                               "library_kernels_checked": order_checked},
            "mismatch_examples": dict(mismatches.most_common(5)),
            "events_per_module_kind": dict(kinds.most_common()),
            "distinct_hlo_ops": len(hlo_ops), "distinct_kernel_names": len({ev.name for ev in events}),
            "top_hlo_ops": dict(hlo_ops.most_common(5)),
            "modules_used": {n: m.module_id for n, m in chosen.items()},
            "by_hlo_op_ms_per_step": {k: v / 1e6 for k, v in sorted(by_hlo_op.items(), key=lambda kv: -kv[1])},
        })
    return prof, dict(ways), unknown


def stacklens_side(index, kernels, sanitize, from_ns: int = 0) -> tuple[dict, collections.Counter, collections.Counter]:
    """Kernel records through JaxIndex.split (the daemon's rules) -> (ns per source line, kernels
    per sanitized name, unmatched ns per name); kernels starting before from_ns only feed the
    index's state (which module ran), they are not counted."""
    sl: dict = collections.defaultdict(float)
    counts = collections.Counter()
    unknown = collections.Counter()
    for k in kernels:
        parts = index.split((), k)
        if k.start_ns < from_ns:
            continue
        counts[sanitize(k.name)] += 1
        if parts is None:
            unknown[k.name] += k.end_ns - k.start_ns
            sl["[unmatched kernel]"] += k.end_ns - k.start_ns
            continue
        for path, m in parts:
            src = [f for f in path if f.kind == "python"]
            key = _line_key(src[-1].file, src[-1].line, src[-1].name) if src else \
                _line_key(op_name=next((f.name for f in path if f.kind == "op"), None))
            sl[key] += m["gpu_time_ns"]
    return sl, counts, unknown


def step_estimates(sl_counts: collections.Counter, prof_counts: collections.Counter, steps: int) -> dict:
    """Steps stacklens saw, from every kernel name the profiler sees a whole number of times per step."""
    ratios = []
    for name, pc in prof_counts.items():
        c = sl_counts.get(name, 0)
        if c and pc % steps == 0:
            ratios.append((c / (pc // steps), name))
    if not ratios:
        return {"names": 0}
    ratios.sort()
    vals = [r for r, _n in ratios]
    med = statistics.median(vals)
    return {"names": len(ratios), "min": vals[0], "median": med, "max": vals[-1],
            "min_name": ratios[0][1], "max_name": ratios[-1][1]}


def check(a) -> int:
    """Runs the check; writes OUT/check_jax.json (the only file: the target's stderr, the agent's
    socket and jax.profiler's trace live in a work folder removed at the end, unless --keep)."""
    out_dir = Path(a.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="stacklens-check-jax."))
    res: dict = {"mode": "cpu" if a.cpu else "gpu", "args": vars(a), "checks": {}}
    t0 = time.monotonic()
    try:
        return _check(a, res, out_dir, work, t0)
    except BaseException as e:
        res["error"] = f"{type(e).__name__}: {e}"[:2000]
        err = work / "target_stderr.log"
        if err.exists():
            res["target_stderr_tail"] = err.read_text(errors="replace")[-2000:]
        res["pass"] = False
        res["elapsed_s"] = round(time.monotonic() - t0, 1)
        (out_dir / "check_jax.json").write_text(json.dumps(res, indent=1, default=str))
        print(f"check_jax: FAIL ({res['error'][:300]}; {out_dir / 'check_jax.json'})", flush=True)
        if isinstance(e, KeyboardInterrupt):
            raise
        return 1
    finally:
        if a.keep:
            print(f"check_jax: work folder kept: {work}", flush=True)
        else:
            shutil.rmtree(work, ignore_errors=True)


def _check(a, res: dict, out_dir: Path, work: Path, t0: float) -> int:
    _importable_stacklens()
    from stacklens.daemon.join.jaxjoin import COMPILE_METRIC, JaxIndex, sanitize
    from stacklens.inject.channel.server import AgentServer
    from stacklens.inject.injector import inject_agent
    from stacklens.records.agent import AgentStats, CompileRecord, HloMapRecord, KernelRecord, Note

    env = dict(os.environ)
    if a.cpu:
        env["JAX_PLATFORMS"] = "cpu"
    elif a.command_buffer == "off":
        env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " " + NO_COMMAND_BUFFER).strip()
    res["xla_flags"] = env.get("XLA_FLAGS", "")
    grow_line = marker_line("GROW")
    argv = [sys.executable, __file__, "--target", "--batch", str(a.batch), "--seq", str(a.seq), "--d", str(a.d),
            "--heads", str(a.heads)]
    err_path = work / "target_stderr.log"       # a file, not a pipe: XLA's logging never blocks the target

    def start(env):
        with open(err_path, "w") as err:
            p = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True, env=env)
        p.err_path = err_path
        return p

    proc = start(env)
    try:
        ready = _expect(proc, "ready", 300)
    except RuntimeError:
        if NO_COMMAND_BUFFER not in env.get("XLA_FLAGS", "") or "xla_gpu_enable_command_buffer" not in \
                err_path.read_text(errors="replace"):
            raise
        # this XLA does not know the flag: run with its default (the profiler side maps by kernel name)
        res["xla_flags_refused"] = err_path.read_text(errors="replace")[-2000:]
        env["XLA_FLAGS"] = env["XLA_FLAGS"].replace(NO_COMMAND_BUFFER, "").strip()
        res["xla_flags"] = env["XLA_FLAGS"]
        print("XLA refused", NO_COMMAND_BUFFER, "- running with command buffers", flush=True)
        proc = start(env)
        ready = None
    recs: list = []
    window: dict = {}
    try:
        ready = ready or _expect(proc, "ready", 300)
        res["backend"] = ready[1] if len(ready) > 1 else "?"
        print(f"target pid {proc.pid} ready ({res['backend']}) after {time.monotonic() - t0:.1f}s", flush=True)
        # -- phase 1: stacklens agent ----------------------------------------------------
        srv = AgentServer(proc.pid, work / "agents", config={"gpu": not a.cpu, "sample_hz": 100})
        try:
            r = inject_agent(proc.pid, srv.path, timeout_s=30)
            print(f"agent attached ({r.method}, {r.latency_s * 1e3:.0f} ms)", flush=True)
            # the JAX watcher has started (listener registered) once its gc scan's maps arrive
            end = time.monotonic() + 30
            while time.monotonic() < end and not any(isinstance(x, HloMapRecord) and "train_step" in x.module
                                                     for x in recs):
                time.sleep(0.1)
                recs.extend(srv.poll())
            window["watcher_ready_s"] = round(time.monotonic() - t0, 2)
            g = _command(proc, "grow", "grown", 300)
            window["grow_ns"] = [int(g[1]), int(g[2])]
            print(f"recompiled train_step for a new shape in {(int(g[2]) - int(g[1])) / 1e9:.2f}s; "
                  f"collecting {a.seconds}s", flush=True)
            c = _command(proc, "count", "count", 60)
            window["start"] = {"steps": int(c[1]), "t_ns": int(c[2])}
            end = time.monotonic() + a.seconds
            while time.monotonic() < end:
                time.sleep(0.2)
                recs.extend(srv.poll())
            c = _command(proc, "count", "count", 60)
            window["end"] = {"steps": int(c[1]), "t_ns": int(c[2])}
            srv.stop_agent(15)
            time.sleep(0.2)
            recs.extend(srv.poll())
            res["server_stats"] = srv.stats()
        finally:
            srv.close()
        # -- phase 2: jax.profiler -------------------------------------------------------------
        log_dir = str(work / "jax_trace")
        _command(proc, f"profile {a.profile_steps} {log_dir}", "profiled", 600)
        events, shape = profiler_events(log_dir, a.cpu)
        res["profiler_xplane"] = shape
        proc.stdin.write("quit\n")
        proc.stdin.flush()
    finally:
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    notes = [f"{r.level}: {r.message}" for r in recs if isinstance(r, Note)]
    hlo = [r for r in recs if isinstance(r, HloMapRecord)]
    all_kernels = _launch_order(r for r in recs if isinstance(r, KernelRecord) and r.end_ns > r.start_ns)
    compiles = [r for r in recs if isinstance(r, CompileRecord)]
    stats = [r for r in recs if isinstance(r, AgentStats)]
    maps = collections.Counter(r.module for r in hlo if r.part == 0)
    res["agent"] = {"notes": notes, "hlo_modules": dict(sorted(maps.items())),
                    "train_step_maps": [{"id": r.module_id[:16], "site": _site(r.site),
                                         "instructions": sum(len(x.kernels) for x in hlo if x.module_id == r.module_id)}
                                        for r in hlo if r.part == 0 and r.module.endswith("train_step")],
                    "kernel_records": len(all_kernels), "graph_kernel_records": sum(1 for k in all_kernels if k.graph_id),
                    "compile_events": len(compiles), "last_stats": dataclasses.asdict(stats[-1]) if stats else None}
    for n in notes:
        print("  agent note:", n)

    # -- recompilation: compile time on the `grow` call site (issue 10 point 2) -----------------------
    def at_grow(frames) -> bool:
        return bool(frames) and Path(frames[-1][0]).name == Path(__file__).name and frames[-1][2] == grow_line
    grow_events = [c for c in compiles if at_grow(c.frames)]
    cidx = JaxIndex()                              # the daemon's compile charge (jaxjoin.compile_charge)
    grow_ns = sum(cidx.compile_charge(c)[1].get(COMPILE_METRIC, 0) for c in grow_events)
    # compile_charge's path ends with the event's innermost frame, the grow line (at_grow): target_main's?
    grow_path_ok = any(c.frames[-1][1].endswith("target_main") for c in grow_events)
    res["recompile"] = {
        "grow_line": grow_line,
        "events_at_grow_site": sorted({c.event for c in grow_events}),
        "compile_ms_at_grow_site": grow_ns / 1e6,
        "other_sites": sorted({f"{Path(c.frames[-1][0]).name}:{c.frames[-1][2]} ({c.frames[-1][1]})" if c.frames
                               else f"[{c.fun_name}]" for c in compiles if not at_grow(c.frames)})[:20],
        "hlo_map_site_at_grow": any(r.module.endswith("train_step") and at_grow(r.site) for r in hlo),
    }

    # The per-line comparison is about the steady-state steps of one executable: its maps leave out
    # the module recompiled at the grow site (same name, same kernel names, maybe other operators);
    # `with_recompiled_module` below shows what the daemon's rules make of both.
    steady = [r for r in hlo if not (r.module.endswith("train_step") and at_grow(r.site))]
    index, pindex = _index(steady), _index(steady)

    # -- the profiler side: per HLO instruction (hlo_op), else kernel name ---------------------------
    pdiag: dict = {}
    prof, ways, prof_unknown = map_profiler(events, pindex, sanitize, a.profile_steps, pdiag)
    res["profiler_mapping"] = ways
    res["profiler_side"] = pdiag
    if pdiag["basis"] != "hlo_op":
        pdiag["note"] = ("the trace's hlo_op stats do not name the instruction each kernel ran (see the "
                         "agreement): the profiler side maps kernels by name like stacklens, so the per-line "
                         "comparison checks GPU time per kernel, not the name matching; by_hlo_op_ms_per_step "
                         "shows what the hlo_op stats alone would give")
    prof_counts = collections.Counter(sanitize(ev.name if not a.cpu else ev.hlo_op) for ev in events)
    res["profiler_command_buffer_events"] = sum(1 for ev in events if ev.hlo_op.startswith("command_buffer"))

    # -- the stacklens side: kernel records (GPU) or, in --cpu, the profiler's events named like XLA:GPU kernels
    after = 0 if a.cpu else window.get("grow_ns", [0, 0])[1]   # the recompile's autotuning kernels are not steps
    if a.cpu:
        kernels = _launch_order(KernelRecord(sanitize(ev.hlo_op), ev.start_ns, ev.start_ns + max(1, int(ev.dur_ns)),
                                             0, ev.stream, i) for i, ev in enumerate(events))
        res["note"] = ("cpu smoke: the stacklens side is fed the profiler's CPU thunk events renamed as "
                       "XLA:GPU names kernels; this checks plumbing, not GPU timing")
    else:
        kernels = [k for k in all_kernels if k.start_ns >= after]     # still in launch order
        res["agent"]["kernel_records_before_grow_end"] = len(all_kernels) - len(kernels)
    sl, sl_counts, sl_unknown = stacklens_side(index, kernels, sanitize)
    # the daemon's view with every map (the recompiled module too), fed every kernel since the
    # attach (its history of which module ran), charging those of the window
    full = _index(hlo)
    sl_full, _c, _u = stacklens_side(full, kernels if a.cpu else all_kernels, sanitize, from_ns=after)

    # -- steps stacklens saw ----------------------------------------------------------------------
    est = step_estimates(sl_counts, prof_counts, a.profile_steps)
    if "start" in window and "end" in window:
        est["target_counter"] = window["end"]["steps"] - window["start"]["steps"]
    res["step_estimates"] = est
    sl_steps = float(est.get("median", 0.0))
    if not sl_steps and not a.cpu and est.get("target_counter"):
        sl_steps = float(est["target_counter"])       # no common kernel name: the target's own count
        est["used"] = "target_counter"
    res["stacklens_steps"] = sl_steps
    res["window"] = window

    total_prof = sum(prof.values())
    total_sl = sum(sl.values()) / sl_steps if sl_steps else 0.0
    res["total_gpu_ms_per_step"] = {"stacklens": total_sl / 1e6, "profiler": total_prof / 1e6}

    def per_step(side: dict, key: str, p: float) -> tuple[float, float]:
        """(stacklens ns per step on the line, its relative difference to the profiler's p)."""
        s = side.get(key, 0.0) / sl_steps if sl_steps else 0.0
        return s, abs(s - p) / p if p else (0.0 if not s else float("inf"))

    rows = []
    ok = total_prof > 0 and sl_steps > 0
    worst = 0.0                                    # over the judged lines, with the recompiled module's maps too
    for key in sorted(set(prof) | set(sl), key=lambda k: -prof.get(k, 0.0)):
        p = prof.get(key, 0.0)
        s, rel = per_step(sl, key, p)
        share = p / total_prof if total_prof else 0.0
        judged = share >= 0.01
        good = (rel <= a.tolerance) if judged else True
        ok = ok and good
        if judged and sl_steps:
            worst = max(worst, per_step(sl_full, key, p)[1])
        rows.append({"line": key, "stacklens_ms_per_step": s / 1e6, "profiler_ms_per_step": p / 1e6,
                     "rel_diff": rel, "profiler_share": share, "judged": judged, "pass": good})
    res["lines"] = rows
    res["with_recompiled_module"] = {"max_rel_diff_judged_lines": worst, "index": full.meta(),
                                     "note": "info only: the daemon's module choice with the recompiled "
                                             "train_step in its maps (same kernel names)"}
    res["unmatched_kernels_ns"] = dict(sl_unknown.most_common(10))
    res["profiler_unknown_ns"] = dict(prof_unknown.most_common(10))
    res["jax_index"] = index.meta()
    res["checks"]["kernel records arrived"] = bool(kernels) or a.cpu
    res["checks"]["hlo map of the train step"] = any("train_step" in m for m in res["agent"]["hlo_modules"])
    res["checks"]["no agent message rejected"] = not any(k.startswith("rejected")
                                                         for k in (res.get("server_stats") or {}))
    if a.cpu:
        res["checks"]["GPU-needed note"] = any("needs a GPU" in n for n in notes)
        res["checks"]["cpu: step estimate exact"] = sl_steps == a.profile_steps
    res["checks"][f"per-line agreement within {a.tolerance:.0%}"] = ok
    res["checks"]["recompile: compile time on the triggering call site"] = bool(
        grow_ns > 0 and grow_path_ok and "/jax/core/compile/backend_compile_duration" in res["recompile"]["events_at_grow_site"])
    passed = all(res["checks"].values())
    res["pass"] = passed
    res["elapsed_s"] = round(time.monotonic() - t0, 1)

    print(f"\n{'source line':48s} {'stacklens ms/step':>18s} {'jax.profiler ms/step':>21s} {'diff':>8s} {'share':>7s}")
    for r in rows:
        mark = "" if r["pass"] else "  <-- FAIL"
        print(f"{r['line'][:48]:48s} {r['stacklens_ms_per_step']:18.4f} {r['profiler_ms_per_step']:21.4f} "
              f"{r['rel_diff']:8.1%} {r['profiler_share']:7.1%}{mark}")
    print(f"{'total':48s} {total_sl / 1e6:18.4f} {total_prof / 1e6:21.4f}")
    print(f"\nstacklens: {len(kernels)} kernels over ~{sl_steps:.1f} steps (estimates {est}), index {index.meta()}")
    print(f"profiler mapping: {ways}; command buffer events: {res['profiler_command_buffer_events']}")
    ag = pdiag["hlo_op_agrees_with_kernel_name"]
    print(f"profiler side basis: {pdiag['basis']} (hlo_op = the instruction the kernel is named after on "
          f"{ag['agree']}/{ag['checked']} events, library kernels {ag['library_kernels_agree']}/"
          f"{ag['library_kernels_checked']}; {pdiag['distinct_hlo_ops']} distinct hlo_ops, "
          f"{pdiag['distinct_kernel_names']} kernel names; top hlo_ops {pdiag['top_hlo_ops']})")
    print(f"profiler events per module/instruction kind: {pdiag['events_per_module_kind']}")
    if pdiag["mismatch_examples"]:
        print(f"profiler kernel -> hlo_op mismatches: {pdiag['mismatch_examples']}")
    if pdiag["basis"] != "hlo_op":
        top = list(pdiag["by_hlo_op_ms_per_step"].items())[:4]
        print(f"  (by hlo_op alone, ms/step, not used: {', '.join(f'{k} {v:.4f}' for k, v in top)})")
    print(f"train_step maps: {res['agent']['train_step_maps']}")
    print(f"recompile: {res['recompile']}")
    if res.get("server_stats"):
        print(f"server stats: {res['server_stats']}")
    if sl_unknown:
        print("unmatched kernel names (ns):", dict(sl_unknown.most_common(10)))
    if prof_unknown:
        print("profiler events with no HLO map entry (ns):", dict(prof_unknown.most_common(10)))
    for name, v in res["checks"].items():
        print(f"{'PASS' if v else 'FAIL'} {name}")
    (out_dir / "check_jax.json").write_text(json.dumps(res, indent=1, default=str))
    print(f"check_jax: {'PASS' if passed else 'FAIL'} ({out_dir / 'check_jax.json'}, {res['elapsed_s']}s)")
    return 0 if passed else 1


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="/tmp/stacklens-check-jax")
    ap.add_argument("--cpu", action="store_true", help="smoke mode without a GPU (JAX_PLATFORMS=cpu)")
    ap.add_argument("--seconds", type=float, default=None, help="agent collection time (default 6, cpu 3)")
    ap.add_argument("--profile-steps", type=int, default=None, help="steps under jax.profiler (default 50, cpu 5)")
    ap.add_argument("--tolerance", type=float, default=0.05)
    ap.add_argument("--command-buffer", choices=("off", "on"), default="off",
                    help="off (default): XLA_FLAGS+=--xla_gpu_enable_command_buffer= ; on: XLA's default CUDA graphs")
    ap.add_argument("--batch", type=int, default=None)
    ap.add_argument("--seq", type=int, default=None)
    ap.add_argument("--d", type=int, default=None)
    ap.add_argument("--heads", type=int, default=None)
    ap.add_argument("--keep", action="store_true",
                    help="keep the work folder (jax.profiler trace, target stderr) and print its path")
    ap.add_argument("--target", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    small = a.cpu or a.target and os.environ.get("JAX_PLATFORMS") == "cpu"
    for k, gpu, cpu in (("seconds", 6.0, 3.0), ("profile_steps", 50, 5), ("batch", 8, 2), ("seq", 512, 32),
                        ("d", 1024, 64), ("heads", 8, 4)):
        if getattr(a, k) is None:
            setattr(a, k, cpu if small else gpu)
    if a.target:
        target_main(a)
        return 0
    return check(a)


if __name__ == "__main__":
    sys.exit(main())
