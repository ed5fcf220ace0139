"""The agent's safety matrix (issue 35): workloads x {probes only, probes + agent} x attach/detach
cycles, all side by side on one GPU through one set of shared BPF programs, as a daemon runs them.

    bash benchmarks/gpu/safety_matrix.sh                    (the device: carry [".device"])
    python benchmarks/gpu/safety_matrix.py --out DIR [--device cuda|cpu] [--workloads a,b]
        [--agent-cycles N --heavy-agent-cycles N --probe-cycles N] [--window-s S] [--deadline-s S]

Per workload two processes of tests/targets/safety_workloads.py start together: the *subject*,
attached and detached again and again, and its *control*, never attached. Counted per workload:
- deaths: the subject ended before it was told to (or exited non-zero);
- new stderr lines: the subject's stderr lines that its control's stderr does not have (both ran
  the same program; what only the profiled one printed is what profiling caused);
- wrong outputs: every episode restarts from the same state, so each episode's outputs must match
  the control's for that shape (relative difference <= TOLERANCE) - and the subject's own first;
- after detach: the subject's median episode time over its control's, each timed alone on the
  machine (every other target SIGSTOPped) in alternating rounds (ABBA: who goes first alternates,
  so a drift cancels), the median of the rounds' ratios after all cycles over the same before any
  attach (two processes differ a little by themselves): acceptance 3 asks <= 1.03. Every target
  runs on the same pinned CPUs (the harness on others); each phase's per-round ratios are kept and
  their spread (min, quartiles, max) reported. ``--no-early`` keeps every attach after the
  "before" timing, so "before" is a process never attached (a timing run wants that).
- while attached (``--during W1,W2``, issue 42): the same rounds with the subject attached, probes
  only, then probes + the agent (each attach held through its rounds, then detached), as ratios
  over "before": the cost of staying attached to a decode server or a training job.
Every agent cycle also asks for two window edges mid-cycle (`ProcessSession.edge`: the agent's
forced CUPTI flush while activities are on, as windows through stacklensd ask it).
Graph workloads are told (a switch file) during some agent windows: the target captures a new CUDA graph (or
records a new cudagraph-tree shape, or compiles a new XLA executable) while attached, and the
window lasts until that shape's first episode is logged. The first agent cycle of the compiled
workloads starts at ``warming``: during compilation and graph capture.
Writes DIR/safety_matrix.json, DIR/safety_matrix.md, DIR/stderr-*.log; exit 0 iff every count is 0.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path

from check_detach import TEARDOWN_WORDS, teeing_agent  # noqa: E402 - this folder is on sys.path

REPO = Path(__file__).resolve().parents[2]
TARGET = REPO / "tests" / "targets" / "safety_workloads.py"
HEAVY = ("jax", "cuda_graph", "compile_ro", "compile_default")     # acceptance 1: >= 20 agent cycles
GRAPH_SWITCH = ("cuda_graph", "compile_ro", "jax", "jax_nocb")    # a new graph captured while attached
EARLY = ("compile_ro", "compile_default", "jax", "cuda_graph")    # first attach at "warming"
TOLERANCE = 1e-3
T0 = time.monotonic()


def log(msg: str) -> None:
    print(f"[+{time.monotonic() - T0:6.1f}s] {msg}", flush=True)


class Target:
    """One process of a workload: its stdout markers, its episode log, its stderr file."""

    def __init__(self, name: str, workload: str, role: str, a, out: Path):
        self.name, self.workload, self.role = name, workload, role
        self.log_path = out / f"episodes-{name}.jsonl"
        self.err_path = out / f"stderr-{name}.log"
        self.switch_path = out / f"switch-{name}"
        self.switches = 0
        env = dict(os.environ)
        program = workload
        if workload == "jax_nocb":
            program = "jax"
            env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_gpu_enable_command_buffer=").strip()
        if program == "jax":
            env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"   # many JAX processes share one GPU
        self.events = {"warming": threading.Event(), "ready": threading.Event()}
        self.proc = subprocess.Popen(
            [sys.executable, str(TARGET), program, "--device", a.device, "--log", str(self.log_path),
             "--steps", str(a.steps), "--pause-s", str(a.pause_s), "--switch-file", str(self.switch_path)],
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=open(self.err_path, "wb"),
            env=env, text=True, start_new_session=True,
            preexec_fn=(lambda: os.sched_setaffinity(0, a.target_cpus)) if a.target_cpus else None)
        self.pid = self.proc.pid
        self.told_to_stop = False
        self.hung: dict | None = None
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            ev = self.events.get(line.strip())
            if ev is not None:
                ev.set()

    def alive(self) -> bool:
        return self.proc.poll() is None

    def episodes(self) -> list[dict]:
        try:
            return [json.loads(x) for x in self.log_path.read_text().splitlines() if x.strip()]
        except (OSError, ValueError):
            return []

    def switch_shape(self, timeout_s: float) -> bool:
        """Tell the target to take its next shape; True once an episode of it is logged."""
        last = max((e["ep"] for e in self.episodes()), default=-1)
        self.switches += 1
        self.switch_path.write_text(str(self.switches))
        return self.wait_new_shape(last, timeout_s)

    def wait_new_shape(self, since_ep: int, timeout_s: float) -> bool:
        end = time.monotonic() + timeout_s
        while time.monotonic() < end and self.alive():
            if any(e["ep"] > since_ep and e.get("new") for e in self.episodes()):
                return True
            time.sleep(0.2)
        return False


def one_cycle(t: Target, mode: str, a, switch: bool) -> dict:
    from stacklens.daemon.session import ProcessSession

    seen: dict = {"notes": [], "gpu_stats": {}}
    rec: dict = {"mode": mode, "switch": switch, "t_start": time.monotonic()}
    sess = ProcessSession(t.pid, agent=mode == "agent", agent_factory=teeing_agent(seen))
    box: dict = {}

    def go():
        try:
            sess.start()
        except BaseException as e:  # noqa: BLE001 - reported per cycle
            box["error"] = f"{type(e).__name__}: {e}"[:500]

    th = threading.Thread(target=go, daemon=True)
    th.start()
    th.join(a.attach_timeout_s)
    if th.is_alive():
        rec["error"] = f"attach did not return within {a.attach_timeout_s:.0f}s"
        th.join(a.attach_timeout_s)           # then detach what it attached: never leave it behind
        try:
            sess.stop()
        except BaseException:  # noqa: BLE001
            pass
        return rec
    if "error" in box:
        rec["error"] = box["error"]
        return rec
    rec["attached_at"] = time.monotonic()
    try:
        if switch:
            rec["new_shape_while_attached"] = t.switch_shape(a.switch_timeout_s)
        time.sleep(a.window_s / 2)
        # a window's edge through the daemon (daemon/windows.py): the agent's forced CUPTI flush
        # while activities are on, twice per cycle, as two windows' edges would ask it
        for _ in range(2):
            _snap, missing = sess.edge(timeout_s=10.0)
            rec.setdefault("edges_not_exact", []).extend(missing)
        time.sleep(a.window_s / 2)
    finally:
        rec["detach_at"] = time.monotonic()
        try:
            sess.stop()
        except BaseException as e:  # noqa: BLE001
            rec["error"] = f"detach: {type(e).__name__}: {e}"[:500]
        rec["detached_at"] = time.monotonic()
    try:
        snap = sess.snapshot()
        rec["kernels"] = None if "kernel_count" in snap.unavailable else snap.total("kernel_count")
        rec["launches"] = snap.total("launch_count")
    except BaseException as e:  # noqa: BLE001
        rec["snapshot_error"] = str(e)[:200]
    rec["teardown"] = next((x for x in seen["notes"] if any(w in x for w in TEARDOWN_WORDS)), None)
    rec["errors"] = [x for x in seen["notes"] if x.startswith("error")][:4]
    rec["alive_after"] = t.alive()
    return rec


def run_cycles(t: Target, a, plan: list[tuple[str, bool]], deadline: float, result: list) -> None:
    for i, (mode, switch) in enumerate(plan):
        if time.monotonic() > deadline or not t.alive():
            break
        try:
            r = one_cycle(t, mode, a, switch)
        except BaseException as e:  # noqa: BLE001
            r = {"mode": mode, "error": f"{type(e).__name__}: {e}"[:500], "trace": traceback.format_exc()[-800:]}
        r["i"] = i
        result.append(r)
        log(f"{t.name} cycle {i} {mode}{' +new graph' if switch else ''}: "
            f"{'ok' if not r.get('error') else r['error'][:120]} alive={t.alive()} "
            f"kernels={r.get('kernels')} teardown={str(r.get('teardown'))[:70]}")
        time.sleep(a.gap_s)


def hang_evidence(t: Target) -> dict:
    """What a target that does not end is doing: each thread's kernel state and wait channel, and
    its Python stacks (faulthandler on SIGUSR2 writes them to its stderr)."""
    ev: dict = {}
    try:
        for tid in os.listdir(f"/proc/{t.pid}/task"):
            base = f"/proc/{t.pid}/task/{tid}"
            with open(f"{base}/stat") as fh:
                state = fh.read().rsplit(")", 1)[1].split()[0]
            with open(f"{base}/wchan") as fh:
                ev[tid] = f"{state} {fh.read().strip()}"
    except OSError as e:
        ev["error"] = str(e)
    try:
        os.kill(t.pid, signal.SIGUSR2)
        time.sleep(2)
    except OSError:
        pass
    return ev


def plan_for(workload: str, a) -> list[tuple[str, bool]]:
    n_agent = a.heavy_agent_cycles if workload in HEAVY else a.agent_cycles
    n_probe = a.probe_cycles
    plan: list[tuple[str, bool]] = []
    every = max(1, (n_agent + n_probe) // max(1, n_probe))
    ai = pi = 0
    while ai < n_agent or pi < n_probe:
        if pi < n_probe and (len(plan) % every == every - 1 or ai >= n_agent):
            plan.append(("probes", False))
            pi += 1
        else:
            switch = workload in GRAPH_SWITCH and (ai == 2 or (workload == "cuda_graph" and ai == 9))
            plan.append(("agent", switch))
            ai += 1
    return plan


def timing_rounds(pairs: dict, workload: str, seconds: float, rounds: int) -> list[dict]:
    """`rounds` x (the subject alone, then the control alone) for `seconds` each: every other
    target SIGSTOPped, so no two processes share the GPU while one is timed."""
    out = []
    everyone = [t for p in pairs.values() for t in p if t.alive()]
    for i in range(rounds):
        r = {}
        for t in (pairs[workload] if i % 4 in (0, 3) else pairs[workload][::-1]):
            others = [o for o in everyone if o is not t and o.alive()]
            for o in others:
                os.kill(o.pid, signal.SIGSTOP)
            try:
                cpu0 = thread_cpu(t.pid)
                t0 = time.monotonic()
                time.sleep(seconds)
                r[t.role] = (t0, time.monotonic())
                cpu1 = thread_cpu(t.pid)
                busy = sorted(((cpu1[k][1] - cpu0[k][1], cpu1[k][0]) for k in cpu1 if k in cpu0), reverse=True)
                r[t.role + "_threads_cpu_ticks"] = [f"{c}:{n}" for n, c in busy[:4]]
            finally:
                for o in others:
                    os.kill(o.pid, signal.SIGCONT)
        out.append(r)
    return out


def timed_while_attached(pairs: dict, workload: str, mode: str, a) -> list[dict] | dict:
    """`timing_rounds` with the subject attached (probes only, or with the agent) for all of
    them; the attach's own time is not in a round. An attach that fails is recorded, not raised."""
    from stacklens.daemon.session import ProcessSession

    subj = pairs[workload][0]
    sess = ProcessSession(subj.pid, agent=mode == "agent")
    try:
        sess.start()
    except Exception as e:  # noqa: BLE001 - the run goes on without this phase
        return {"error": f"{type(e).__name__}: {e}"[:300]}
    try:
        time.sleep(1.0)          # past the attach's first events (the agent's first flush)
        return timing_rounds(pairs, workload, a.timing_s, a.timing_rounds)
    finally:
        sess.stop()


def thread_cpu(pid: int) -> dict:
    """{tid: (comm, utime + stime ticks)} of a process's threads."""
    out = {}
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/stat") as fh:
                head, tail = fh.read().rsplit(")", 1)
            f = tail.split()
            out[tid] = (head.split("(", 1)[1], int(f[11]) + int(f[12]))
    except OSError:
        pass
    return out


def median_dur(eps: list[dict], lo: float, hi: float) -> float | None:
    d = [e["dur"] for e in eps if lo <= e["start"] and e["start"] + e["dur"] <= hi]
    return statistics.median(d) if len(d) >= 3 else None


def spread(xs: list[float]) -> str:
    """min / lower quartile / upper quartile / max of sorted values, e.g. '0.98 [0.99 1.01] 1.04'."""
    if len(xs) < 4:
        return " ".join(f"{x:.3f}" for x in xs)
    q = statistics.quantiles(xs, n=4)
    return f"{xs[0]:.3f} [{q[0]:.3f} {q[2]:.3f}] {xs[-1]:.3f}"


def compare_outputs(subj: list[dict], ctrl: list[dict]) -> dict:
    ref: dict = {}
    for e in ctrl:
        ref.setdefault(e["shape"], e["out"])
    own: dict = {}
    bad, worst, n = [], 0.0, 0
    for e in subj:
        own.setdefault(e["shape"], e["out"])
        for against in (ref.get(e["shape"]), own[e["shape"]]):
            if against is None:
                continue
            n += 1
            if len(against) != len(e["out"]):
                bad.append(e["ep"])
                continue
            for x, y in zip(e["out"], against):
                rel = abs(x - y) / max(abs(y), 1e-6)
                if not rel <= TOLERANCE:              # NaN counts as wrong
                    bad.append(e["ep"])
                worst = max(worst, rel) if rel == rel else float("inf")
    return {"compared": n, "wrong_episodes": sorted(set(bad))[:20], "wrong": len(set(bad)),
            "max_rel_diff": worst, "shapes": sorted(own)}


def new_stderr_lines(subj: Target, ctrl: Target) -> list[str]:
    def lines(p: Path) -> list[str]:
        try:
            return p.read_text(errors="replace").splitlines()
        except OSError:
            return []
    theirs = set(lines(ctrl.err_path))
    return [x for x in lines(subj.err_path) if x not in theirs][:40]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--workloads", default="eager_train,decode,compile_default,compile_ro,cuda_graph,"
                                           "dataloader,two_threads,jax,jax_nocb")
    ap.add_argument("--agent-cycles", type=int, default=5)
    ap.add_argument("--heavy-agent-cycles", type=int, default=20)
    ap.add_argument("--probe-cycles", type=int, default=5)
    ap.add_argument("--window-s", type=float, default=1.0)
    ap.add_argument("--gap-s", type=float, default=0.3)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--pause-s", type=float, default=0.02)
    ap.add_argument("--timing-s", type=float, default=2.0)
    ap.add_argument("--timing-rounds", type=int, default=3)
    ap.add_argument("--attach-timeout-s", type=float, default=120.0)
    ap.add_argument("--switch-timeout-s", type=float, default=150.0)
    ap.add_argument("--ready-timeout-s", type=float, default=300.0)
    ap.add_argument("--deadline-s", type=float, default=480.0)
    ap.add_argument("--no-early", dest="early", action="store_false",
                    help="no attach before the 'before' timing (during warm-up)")
    ap.add_argument("--during", default="decode,eager_train",
                    help="workloads also timed while attached (probes only, then with the agent); '' for none")
    ap.add_argument("--pin", action="store_true",
                    help="targets on CPUs 2..N-1, this harness on 0-1")
    a = ap.parse_args()
    a.target_cpus = None
    if a.pin and os.cpu_count() and os.cpu_count() > 4:
        a.target_cpus = list(range(2, os.cpu_count()))
        os.sched_setaffinity(0, {0, 1})
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    workloads = [w for w in a.workloads.split(",") if w]
    deadline = T0 + a.deadline_s
    pairs = {w: (Target(f"{w}-subject", w, "subject", a, out), Target(f"{w}-control", w, "control", a, out))
             for w in workloads}
    log(f"started {len(pairs) * 2} targets: {', '.join(workloads)}")
    results: dict = {w: {"cycles": []} for w in workloads}
    # the compiled workloads' first agent cycle starts at "warming": attach during compilation
    early_threads = []
    for w in workloads:
        s = pairs[w][0]
        if a.early and w in EARLY and s.events["warming"].wait(a.ready_timeout_s):
            th = threading.Thread(target=run_cycles, args=(s, a, [("agent", False)], deadline,
                                                           results[w]["cycles"]), daemon=True)
            th.start()
            early_threads.append(th)
    for th in early_threads:
        th.join(a.attach_timeout_s * 2)
    for w, (s, c) in pairs.items():
        for t in (s, c):
            if not t.events["ready"].wait(max(1.0, a.ready_timeout_s - (time.monotonic() - T0))):
                log(f"{t.name} not ready (alive={t.alive()})")
    log("all ready: timing before any cycle")
    timing = {w: {} for w in workloads}
    for w in workloads:
        if time.monotonic() < deadline:
            timing[w]["before"] = timing_rounds(pairs, w, a.timing_s, a.timing_rounds)
    for w in [w for w in a.during.split(",") if w in pairs]:
        for mode in ("probes", "agent"):
            if time.monotonic() < deadline - 60:
                timing[w][mode] = timed_while_attached(pairs, w, mode, a)
    threads = []
    cycle_deadline = deadline - len(workloads) * (2 * a.timing_s * a.timing_rounds + 1) - 10
    for w in workloads:
        plan = plan_for(w, a)
        if results[w]["cycles"]:
            plan = plan[1:] if plan and plan[0][0] == "agent" else plan
        th = threading.Thread(target=run_cycles, args=(pairs[w][0], a, plan, cycle_deadline,
                                                       results[w]["cycles"]), daemon=True)
        th.start()
        threads.append(th)
    for th in threads:
        th.join()
    # the control takes the subject's shape switches too (unattached): both are timed on the same
    # shape, with the same compilations behind them
    for w, (subj, ctrl) in pairs.items():
        while ctrl.switches < subj.switches and ctrl.alive():
            if not ctrl.switch_shape(a.switch_timeout_s):
                log(f"{ctrl.name}: no episode of its new shape within {a.switch_timeout_s:.0f}s")
    log("cycles done: timing after detach")
    for w in workloads:
        timing[w]["after"] = timing_rounds(pairs, w, a.timing_s, a.timing_rounds)
    # what detach may have left behind, read before anything ends: threads per process (subject vs
    # control), the perf events this harness still holds (a uprobe not detached holds one)
    leftovers = {t.name: len(os.listdir(f"/proc/{t.pid}/task")) for p in pairs.values() for t in p if t.alive()}
    leftovers["harness_perf_event_fds"] = sum(
        1 for fd in os.listdir("/proc/self/fd") if "perf_event" in os.path.realpath(f"/proc/self/fd/{fd}"))
    (out / "timing.json").write_text(json.dumps({"timing": timing, "leftovers": leftovers}, default=str))
    log(f"left behind: {leftovers}")
    for s, c in pairs.values():
        for t in (s, c):
            t.told_to_stop = True
            if t.alive():
                t.proc.send_signal(signal.SIGTERM)
    for s, c in pairs.values():
        for t in (s, c):
            try:
                t.proc.wait(60)
            except subprocess.TimeoutExpired:
                t.hung = hang_evidence(t)
                t.proc.kill()
                t.proc.wait(30)
    summary = {}
    ok = True
    for w, (s, c) in pairs.items():
        cyc = results[w]["cycles"]
        se, ce = s.episodes(), c.episodes()
        row = {
            "agent_cycles": sum(1 for r in cyc if r["mode"] == "agent" and not r.get("error")),
            "probe_cycles": sum(1 for r in cyc if r["mode"] == "probes" and not r.get("error")),
            "cycle_errors": [r.get("error") for r in cyc if r.get("error")][:5],
            "agent_errors": [e for r in cyc for e in r.get("errors", [])][:5],
            "new_graph_while_attached": [r.get("new_shape_while_attached") for r in cyc if r.get("switch")],
            "subject_rc": s.proc.returncode, "control_rc": c.proc.returncode,
            "hung_at_exit": [x.hung for x in (s, c) if x.hung],
            "died": s.proc.returncode not in (0,) or any(r.get("alive_after") is False for r in cyc),
            "control_died": c.proc.returncode != 0,
            "new_stderr": new_stderr_lines(s, c),
            "outputs": compare_outputs(se, ce),
            "episodes": [len(se), len(ce)],
            "last_shapes": [se[-1]["shape"] if se else None, ce[-1]["shape"] if ce else None],
            "teardowns": sorted({str(r.get("teardown"))[:90] for r in cyc if r["mode"] == "agent"}),
            "kernels_per_agent_cycle": [r.get("kernels") for r in cyc if r["mode"] == "agent"][:30],
        }
        ratio = {}
        for phase in ("before", "probes", "agent", "after"):
            per_round = []
            rounds = timing[w].get(phase, [])
            if not isinstance(rounds, list):      # {"error": …}: the attach for that phase failed
                ratio[phase] = rounds
                continue
            for rnd in rounds:
                if "subject" in rnd and "control" in rnd:
                    ms = median_dur(se, rnd["subject"][0] + 0.3, rnd["subject"][1])
                    mc = median_dur(ce, rnd["control"][0] + 0.3, rnd["control"][1])
                    if ms and mc:
                        per_round.append((ms, mc, ms / mc))
            if per_round:
                rs = sorted(x[2] for x in per_round)
                ratio[phase] = {"subject_ms": [round(x[0] * 1e3, 3) for x in per_round],
                                "control_ms": [round(x[1] * 1e3, 3) for x in per_round],
                                "round_ratios": [round(x, 4) for x in rs],
                                "spread": spread(rs),
                                "ratio": round(statistics.median(rs), 4)}
        rb = ratio.get("before", {}).get("ratio")
        for phase in ("probes", "agent", "after"):
            rp = ratio.get(phase, {}).get("ratio")
            ratio[f"{phase}_over_before"] = round(rp / rb, 4) if rp and rb else None
        row["timing"] = ratio
        row["pass"] = (not row["died"] and not row["cycle_errors"] and not row["new_stderr"]
                       and row["outputs"]["wrong"] == 0 and all(row["new_graph_while_attached"]))
        ok = ok and row["pass"]
        summary[w] = row
    (out / "safety_matrix.json").write_text(json.dumps({"summary": summary, "cycles": results,
                                                        "timing": timing, "leftovers": leftovers, "args": vars(a)},
                                                       indent=1, default=str))
    md = ["| workload | agent cycles | probe cycles | deaths | new stderr | wrong outputs | new graph while attached | "
          "probes attached/before | agent attached/before | after/before (subject/control) | before: rounds' spread | "
          "after: rounds' spread | teardown |",
          "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for w, r in summary.items():
        md.append(f"| {w} | {r['agent_cycles']} | {r['probe_cycles']} | {int(r['died'])} | {len(r['new_stderr'])} | "
                  f"{r['outputs']['wrong']} of {r['outputs']['compared']} | {r['new_graph_while_attached'] or '-'} | "
                  f"{r['timing'].get('probes_over_before') or '-'} | {r['timing'].get('agent_over_before') or '-'} | "
                  f"{r['timing'].get('after_over_before')} | {r['timing'].get('before', {}).get('spread')} | "
                  f"{r['timing'].get('after', {}).get('spread')} | {'; '.join(r['teardowns'])[:160]} |")
    (out / "safety_matrix.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
