"""What the injected agent's Python-frame sampler costs the target's main thread.

Run as root from the repository root (about 8 minutes):
    .venv/bin/python benchmarks/bench_agent_sampler.py [--mode all|micro|injected|inproc] [--base REV]
Prints Markdown tables (copied into docs/benchmarks/agent-sampler.md).

Targets (this file, with ``--target`` or ``--inproc``):
- ``smallop``: one unit = 1000 x ``x.add_(1.0)`` on a 16-element CPU tensor (torch releases the GIL
  around every op, so the main thread and a waking agent thread race for it all the time);
- ``deep``: one unit = one call of a 13-level chain of torch.nn.Modules (~45 Python frames at the
  leaf, like a timm model's module calls) whose leaf does 200 small torch ops.

Variants, interleaved (ABAB...) so drift and noisy neighbours hit all alike:
- ``none``: no agent;
- ``base``: the agent as committed at ``--base`` (default HEAD), sampler at ``--hz`` (100);
- ``new``: the agent of the working tree, sampler at ``--hz``;
- ``idle``: the working tree's agent with the sampler at 0.1 Hz (its loop, flushes and stats only).
Every agent runs with ``gpu: False``.

Three modes (``--mode all`` runs them in turn):
- ``micro``: in one process, each agent package's sample() + batch.add while a thread runs the
  workload, and its real loop for 3 s with the loop's wake-ups counted;
- ``injected``: the real attach (AgentServer + inject_agent, the bootstrap's switch interval),
  ``--rounds`` rounds of ``--window`` s windows. Attach and detach take a second, so windows are
  long, and on a shared 2-CPU VM one window's rate moves by +-5%: good for the agent's own numbers
  (its CPU, samples/s, sample cost), too coarse for a 1% slowdown.
- ``inproc``: the target loads each agent package as the bootstrap does and starts / stops it
  itself (a socketpair, the bootstrap's switch interval while it runs), so a phase lasts
  ``--inproc-window`` s and the variants rotate through ``--inproc-rounds`` rounds. One extra
  idle thread (the phase controller) is in every sample.
Slowdowns are per round against that round's ``none`` window, then the median over rounds. "Per s
not waiting for a CPU" divides by wall time minus the main thread's run-queue wait (/proc
schedstat): other processes preempting the target drop out, GIL waits and extra CPU stay in.
"""

from __future__ import annotations

import argparse
import bisect
import json
import os
import platform
import select
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


# -- targets ----------------------------------------------------------------------------------
def _report_rates(unit) -> None:
    """Every 0.5 s: "rate <monotonic ns> <units per wall s> <per main-thread CPU s> <per s not
    waiting for a CPU>". The last divides by wall time minus the main thread's run-queue wait
    (/proc schedstat): other processes preempting the target (this VM is shared) drop out, while
    what the agent costs the main thread (GIL waits, its extra CPU) stays in."""
    tid = threading.get_native_id()

    def runq_ns() -> int:
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                return int(f.read().split()[1])
        except (OSError, IndexError, ValueError):
            return 0

    print("ready", flush=True)
    t0, c0, q0, n = time.monotonic(), time.thread_time(), runq_ns(), 0
    while True:
        unit()
        n += 1
        t = time.monotonic()
        if t - t0 >= 0.5:
            c, q = time.thread_time(), runq_ns()
            print(f"rate {time.monotonic_ns()} {n / (t - t0):.2f} {n / max(c - c0, 1e-9):.2f} "
                  f"{n / max(t - t0 - (q - q0) / 1e9, 1e-9):.2f}", flush=True)
            t0, c0, q0, n = t, c, q, 0


def _deep_model(levels: int = 12):
    """A chain of distinct Module classes (distinct code objects and qualnames, as in a real
    model); each level is three frames (Module._wrapped_call_impl, _call_impl, forward)."""
    import torch

    class Leaf(torch.nn.Module):
        def forward(self, x):
            for _ in range(200):
                x.add_(1.0)
            return x

    model = Leaf()
    for i in range(levels):
        ns: dict = {"torch": torch}
        exec(f"class Level{i}(torch.nn.Module):\n"
             f"    def __init__(self, inner):\n"
             f"        super().__init__()\n"
             f"        self.inner = inner\n"
             f"    def forward(self, x):\n"
             f"        return self.inner(x)\n", ns)
        model = ns[f"Level{i}"](model)
    return model


def _make_unit(kind: str):
    import torch
    torch.set_num_threads(1)
    x = torch.zeros(16)
    if kind == "smallop":
        def unit():
            for _ in range(1000):
                x.add_(1.0)
    else:
        model = _deep_model()

        def unit():
            with torch.no_grad():
                model(x)
    return unit


def run_target(kind: str) -> None:
    _report_rates(_make_unit(kind))


# -- in-process mode: the agent started and stopped every phase ---------------------------------
def _schedstat(tid: int) -> tuple[int, int]:
    """(ns on a CPU, ns waiting for one) of a thread of this process."""
    with open(f"/proc/self/task/{tid}/schedstat") as f:
        run, wait = f.read().split()[:2]
    return int(run), int(wait)


def _load_agent(name: str, d: str):
    """The agent package from directory d, loaded as the bootstrap loads it (no bytecode)."""
    import types
    m = types.ModuleType(name)
    m.__file__ = d + "/__init__.py"
    m.__path__ = [d]
    m.__package__ = name
    sys.modules[name] = m
    with open(m.__file__, "rb") as f:
        exec(compile(f.read(), m.__file__, "exec"), m.__dict__)
    return m


def _run_agent_phase(mod, hz: float, settle: float, window: float, main_tid: int) -> dict:
    """Start an agent like an attach does (its thread, switch interval), measure, stop it."""
    from stacklens.inject.bootstrap import SWITCH_INTERVAL_S

    a, d = socket.socketpair()
    d.sendall(mod._sub("wire").encode({"t": "config", "sample_hz": hz, "gpu": False}))
    prev = sys.getswitchinterval()
    sys.setswitchinterval(min(prev, SWITCH_INTERVAL_S))
    th = threading.Thread(target=mod.main, args=(a, "token"), name="stacklens-agent", daemon=True)
    th.start()
    time.sleep(settle)
    r0, q0, c0 = *_schedstat(main_tid), _schedstat(th.native_id)[0]
    t0 = time.monotonic_ns()
    time.sleep(window)
    t1 = time.monotonic_ns()
    r1, q1, c1 = *_schedstat(main_tid), _schedstat(th.native_id)[0]
    d.sendall(mod._sub("wire").encode({"t": "stop"}))
    buf = bytearray()
    while th.is_alive():              # read while it detaches (it drains its outbox)
        if select.select([d], [], [], 0.05)[0]:
            buf += d.recv(1 << 20)
    a.close()
    while chunk := d.recv(1 << 20):
        buf += chunk
    d.close()
    sys.setswitchinterval(prev)
    samples, stats = 0, {}
    for msg in mod._sub("wire").decode_all(buf)[0]:
        if msg["t"] == "samples":
            samples += sum(1 for s in msg["s"] if t0 <= s[1] <= t1 and s[0] == main_tid)
        elif msg["t"] == "stats":
            stats = msg
    return {"t0": t0, "t1": t1, "run_ns": r1 - r0, "wait_ns": q1 - q0, "agent_cpu_ns": c1 - c0,
            "samples": samples, "cost_us": stats.get("sample_cost_us", float("nan"))}


def run_inproc(kind: str, variants: dict, rounds: int, window: float, settle: float = 0.15) -> None:
    """Phases under a second, the variants in a rotated order every round: drift on this
    shared VM (other processes, frequency) cancels far better than with attach-sized windows.
    Prints one JSON line of per-phase results."""
    unit = _make_unit(kind)
    mods = {name: _load_agent(f"_stacklens_agent_bench_{name}", str(src))
            for name, (src, _hz) in variants.items() if src}
    main_tid = threading.get_native_id()
    marks: list[int] = []
    phases: list[dict] = []
    done = threading.Event()

    def controller() -> None:
        time.sleep(1.0)                           # warm-up
        names = list(variants)
        for r in range(rounds):
            for name in names[r % len(names):] + names[:r % len(names)]:
                src, hz = variants[name]
                if src is None:
                    time.sleep(settle)
                    r0, q0 = _schedstat(main_tid)
                    t0 = time.monotonic_ns()
                    time.sleep(window)
                    t1 = time.monotonic_ns()
                    r1, q1 = _schedstat(main_tid)
                    ph = {"t0": t0, "t1": t1, "run_ns": r1 - r0, "wait_ns": q1 - q0}
                else:
                    ph = _run_agent_phase(mods[name], hz, settle, window, main_tid)
                ph.update(name=name, round=r)
                phases.append(ph)
        done.set()

    threading.Thread(target=controller, name="bench-controller", daemon=True).start()
    now = time.monotonic_ns
    while not done.is_set():
        unit()
        marks.append(now())
    for ph in phases:
        i = bisect.bisect_left(marks, ph["t0"])
        j = bisect.bisect_right(marks, ph["t1"]) - 1
        span = marks[j] - marks[i]
        ph["units"], ph["span_ns"] = j - i, span
        # wall rate over whole units; "run" rate over wall minus the main thread's run-queue wait
        ph["wall"] = (j - i) / (span / 1e9)
        ph["run"] = (j - i) / ((span - ph["wait_ns"] * span / (ph["t1"] - ph["t0"])) / 1e9)
        ph["cpu"] = (j - i) / (ph["run_ns"] * span / (ph["t1"] - ph["t0"]) / 1e9)
    print(json.dumps(phases), flush=True)


# -- micro mode: the sampler and the agent loop, in this process ----------------------------------
def run_micro(kind: str, variants: dict, rounds: int = 20) -> None:
    """Per agent package: sample() + _SampleBatch.add per sample, and message() + encode per flush
    of 20 samples, taken 0.3 ms apart while a thread runs the workload (caches as busy as in a
    target); then the real agent loop for 3 s at 100 Hz with Channel.pump counted (each call is one
    poll(), which gives the GIL away and takes it back). Prints one JSON line."""
    from stacklens.inject.bootstrap import SWITCH_INTERVAL_S

    mods = {name: _load_agent(f"_stacklens_agent_micro_{name}", str(src))
            for name, (src, _hz) in variants.items() if src and name != "idle"}
    unit = _make_unit(kind)
    stop = threading.Event()

    def work():
        while not stop.is_set():
            unit()

    worker = threading.Thread(target=work, daemon=True)
    worker.start()
    res: dict = {n: {"sample_us": [], "flush_us": []} for n in mods}
    for _ in range(rounds):
        for name, mod in mods.items():
            sampler = mod._sub("sampler").Sampler(hz=100, skip_idents={threading.get_ident()})
            batch, wire = mod._SampleBatch(), mod._sub("wire")
            costs = []
            for i in range(400):
                t0 = time.perf_counter()
                for row in sampler.sample():
                    batch.add(row)
                costs.append(time.perf_counter() - t0)
                time.sleep(0.0003)
                if i % 20 == 19:
                    t0 = time.perf_counter()
                    wire.encode(batch.message())
                    batch.clear()
                    res[name]["flush_us"].append((time.perf_counter() - t0) * 1e6)
            res[name]["sample_us"].append(statistics.median(costs[50:]) * 1e6)
    prev = sys.getswitchinterval()
    sys.setswitchinterval(min(prev, SWITCH_INTERVAL_S))
    for name, mod in mods.items():
        a, d = socket.socketpair()
        d.sendall(mod._sub("wire").encode({"t": "config", "sample_hz": 100.0, "gpu": False}))
        agent = mod.Agent(a, "token")
        calls = [0, 0]
        pump = agent.ch.pump

        def counted(timeout_s, pump=pump, calls=calls):
            calls[0] += 1
            calls[1] += int(timeout_s * 1000) == 0
            return pump(timeout_s)

        agent.ch.pump = counted
        th = threading.Thread(target=agent.run, daemon=True)
        th.start()
        time.sleep(0.3)
        c0 = list(calls)
        t0 = time.monotonic()
        end = t0 + 3.0
        while time.monotonic() < end:
            if select.select([d], [], [], 0.05)[0]:
                d.recv(1 << 20)
        dt = time.monotonic() - t0
        res[name].update(pumps_s=(calls[0] - c0[0]) / dt, poll0_s=(calls[1] - c0[1]) / dt)
        agent.stop_requested = True
        while th.is_alive():
            if select.select([d], [], [], 0.05)[0]:
                d.recv(1 << 20)
        a.close()
        d.close()
    sys.setswitchinterval(prev)
    stop.set()
    worker.join()                     # torch aborts if the interpreter exits under a running op
    for r in res.values():
        r["sample_us"] = statistics.median(r["sample_us"])
        r["flush_us"] = statistics.median(r["flush_us"])
    print(json.dumps(res), flush=True)


# -- harness ----------------------------------------------------------------------------------
class Target:
    """A target process of this file; its rate lines are kept with their time."""

    def __init__(self, kind: str) -> None:
        self.p = subprocess.Popen([sys.executable, __file__, "--target", kind], stdout=subprocess.PIPE, text=True)
        assert self.p.stdout.readline() == "ready\n"
        self.rates: list[tuple[int, float, float, float]] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.p.stdout:
            _, t, wall, cpu, run = line.split()
            self.rates.append((int(t), float(wall), float(cpu), float(run)))

    def window(self, seconds: float) -> dict:
        t0 = time.monotonic_ns()
        time.sleep(seconds)
        t1 = time.monotonic_ns()
        vals = [v for v in self.rates if t0 < v[0] <= t1]
        return {k: statistics.mean(v[i] for v in vals) if vals else float("nan")
                for i, k in ((1, "wall"), (2, "cpu"), (3, "run"))}

    def close(self) -> None:
        self.p.kill()
        self.p.wait()


def _agent_tree(rev: str) -> Path:
    """The agent package as committed at rev, in a temporary directory."""
    d = Path(tempfile.mkdtemp(prefix="agent-base-"))
    names = subprocess.run(["git", "ls-tree", "--name-only", rev, "inject/agent/"], cwd=ROOT, check=True,
                           capture_output=True, text=True).stdout.split()
    for n in names:
        if n.endswith(".py"):
            src = subprocess.run(["git", "show", f"{rev}:{n}"], cwd=ROOT, check=True, capture_output=True).stdout
            (d / Path(n).name).write_bytes(src)
    return d


def _thread_counters(pid: int, tid: int) -> tuple[float, int]:
    """(CPU seconds from schedstat, voluntary context switches) of one thread."""
    try:
        with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
            cpu = int(f.read().split()[0]) / 1e9
        with open(f"/proc/{pid}/task/{tid}/status") as f:
            vcs = next(int(line.split()[1]) for line in f if line.startswith("voluntary_ctxt_switches"))
        return cpu, vcs
    except (OSError, StopIteration, ValueError):
        return float("nan"), 0


def measure(kind: str, variants: dict, rounds: int, window: float) -> dict:
    from stacklens.inject.channel import server as server_mod
    from stacklens.inject.channel.server import AgentServer
    from stacklens.inject.injector import inject_agent
    from stacklens.records.agent import AgentStats, PySample

    t = Target(kind)
    pid = t.p.pid
    res: dict[str, list[dict]] = {name: [] for name in variants}
    try:
        time.sleep(2.0)                      # imports and warm-up
        for _ in range(rounds):
            for name, (src, hz) in variants.items():
                if src is None:
                    m0 = _thread_counters(pid, pid)
                    row = t.window(window)
                    m1 = _thread_counters(pid, pid)
                else:
                    server_mod.AGENT_SRC = src
                    with AgentServer(pid, Path(tempfile.mkdtemp()) / "agents",
                                     config={"sample_hz": hz, "gpu": False}) as srv:
                        inject_agent(pid, srv.path, timeout_s=10)
                        time.sleep(0.5)
                        srv.poll()
                        atid = srv.hello.tid
                        m0, a0 = _thread_counters(pid, pid), _thread_counters(pid, atid)
                        row = t.window(window)
                        m1, a1 = _thread_counters(pid, pid), _thread_counters(pid, atid)
                        recs = srv.poll()
                        srv.stop_agent()
                    stats = [r for r in recs if isinstance(r, AgentStats)]
                    row["samples_s"] = sum(isinstance(r, PySample) and r.tid == pid for r in recs) / window
                    row["cost_us"] = statistics.median(s.sample_cost_us for s in stats) if stats else float("nan")
                    row["agent_cpu"] = (a1[0] - a0[0]) / window
                row["main_vcs"] = (m1[1] - m0[1]) / window
                res[name].append(row)
                time.sleep(0.5)
    finally:
        t.close()
    return res


def summarize(res: dict) -> list[dict]:
    base = res["none"]
    out = []
    for name, rows in res.items():
        def med(k, rows=rows):
            return statistics.median(r[k] for r in rows)

        def slow(k, rows=rows):
            return statistics.median(b[k] / r[k] for b, r in zip(base, rows))

        s = {"variant": name, "wall": med("wall"), "main_vcs": med("main_vcs"),
             "slow_wall": slow("wall"), "slow_cpu": slow("cpu"), "slow_run": slow("run"),
             "rounds_run": [b["run"] / r["run"] for b, r in zip(base, rows)]}
        if name != "none":
            s.update(samples_s=med("samples_s"), cost_us=med("cost_us"), agent_cpu=med("agent_cpu"))
        out.append(s)
    return out


def measure_inproc(kind: str, variants: dict, rounds: int, window: float) -> dict:
    out = subprocess.run([sys.executable, __file__, "--inproc", kind, "--spec", _spec(variants),
                          "--rounds", str(rounds), "--window", str(window)],
                         check=True, capture_output=True, text=True).stdout
    phases = json.loads(out.strip().splitlines()[-1])
    res: dict[str, list[dict]] = {n: [] for n in variants}
    by_round: dict[int, dict] = {}
    for ph in phases:
        by_round.setdefault(ph["round"], {})[ph["name"]] = ph
    for r in sorted(by_round):
        for n, ph in by_round[r].items():
            row = {k: ph[k] for k in ("wall", "cpu", "run")}
            row["main_vcs"] = float("nan")
            if n != "none":
                win = (ph["t1"] - ph["t0"]) / 1e9
                row.update(samples_s=ph["samples"] / win, cost_us=ph["cost_us"],
                           agent_cpu=ph["agent_cpu_ns"] / 1e9 / win)
            res[n].append(row)
    return res


def _print_table(rows: list[dict], per_round: bool) -> None:
    print("| variant | units/s | slowdown: wall | per main-thread CPU s | per s not waiting for a CPU "
          "| same: quartiles over rounds | main thread sleeps/s | agent CPU ms/s | samples/s seen "
          "| sample cost µs (agent's stats) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for s in rows:
        q = statistics.quantiles(s["rounds_run"], n=4) if len(s["rounds_run"]) > 1 else s["rounds_run"] * 3
        spread = (" ".join(f"{x:.3f}" for x in s["rounds_run"]) if per_round
                  else f"{q[0]:.3f} / {q[1]:.3f} / {q[2]:.3f}")
        extra = ("| | | |" if s["variant"] == "none" else
                 f"| {s['agent_cpu'] * 1e3:.1f} | {s['samples_s']:.0f} | {s['cost_us']:.1f} |")
        vcs = "" if s["main_vcs"] != s["main_vcs"] else f"{s['main_vcs']:.0f}"
        print(f"| {s['variant']} | {s['wall']:.1f} | {s['slow_wall']:.4f}x | {s['slow_cpu']:.4f}x | "
              f"{s['slow_run']:.4f}x | {spread} | {vcs} {extra}")
    print()


def _spec(variants: dict) -> str:
    return json.dumps({n: (str(src) if src else None, hz) for n, (src, hz) in variants.items()})


def _print_micro(kind: str, variants: dict) -> None:
    out = subprocess.run([sys.executable, __file__, "--micro", kind, "--spec", _spec(variants)], check=True,
                         capture_output=True, text=True).stdout
    res = json.loads(out.strip().splitlines()[-1])
    print(f"### {kind}, in-process micro: the sampler beside a busy workload thread; the agent loop for 3 s\n")
    print("| agent | sample() + batch.add per sample, µs (median) | message + encode per flush of 20 samples, µs "
          "| loop wake-ups (Channel.pump calls)/s | of which poll(0)/s |")
    print("|---|---|---|---|---|")
    for name, r in res.items():
        print(f"| {name} | {r['sample_us']:.1f} | {r['flush_us']:.1f} | {r['pumps_s']:.0f} | {r['poll0_s']:.0f} |")
    print()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", choices=("smallop", "deep"), help=argparse.SUPPRESS)
    ap.add_argument("--inproc", choices=("smallop", "deep"), help=argparse.SUPPRESS)
    ap.add_argument("--micro", choices=("smallop", "deep"), help=argparse.SUPPRESS)
    ap.add_argument("--spec", help=argparse.SUPPRESS)
    ap.add_argument("--mode", choices=("injected", "inproc", "micro", "all"), default="all")
    ap.add_argument("--targets", default="smallop,deep")
    ap.add_argument("--variants", default="none,base,new,idle")
    ap.add_argument("--base", default="HEAD", help="git revision of the 'base' agent")
    ap.add_argument("--hz", type=float, default=100.0, help="sample rate of the base and new agents")
    ap.add_argument("--rounds", type=int, default=6, help="rounds of the injected mode")
    ap.add_argument("--window", type=float, default=3.0, help="seconds per window of the injected mode")
    ap.add_argument("--inproc-rounds", type=int, default=40)
    ap.add_argument("--inproc-window", type=float, default=0.6)
    args = ap.parse_args()
    if args.target:
        return run_target(args.target)
    if args.inproc or args.micro:
        spec = {n: (src, hz) for n, (src, hz) in json.loads(args.spec).items()}
        if args.micro:
            return run_micro(args.micro, spec)
        return run_inproc(args.inproc, spec, args.rounds, args.window)
    from stacklens.inject.channel import server as server_mod
    work = server_mod.AGENT_SRC
    known = {"none": (None, None), "base": (_agent_tree(args.base), args.hz), "new": (work, args.hz),
             "idle": (work, 0.1)}
    names = args.variants.split(",")
    if names[0] != "none":
        raise SystemExit("--variants must start with none (the reference of every ratio)")
    variants = {n: known[n] for n in names}
    rev = subprocess.run(["git", "rev-parse", "--short", args.base], cwd=ROOT, capture_output=True,
                         text=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "inject/agent"], cwd=ROOT, capture_output=True,
                           text=True).stdout.strip()
    print(f"machine: {platform.node()} {platform.machine()}, {os.cpu_count()} CPUs, kernel {platform.release()}, "
          f"Python {platform.python_version()}; load average before: "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(f"base = agent at {rev}; new = working tree{' (modified)' if dirty else ''}; agents at {args.hz:g} Hz "
          f"(idle: 0.1 Hz)\n")
    for kind in args.targets.split(","):
        if args.mode in ("micro", "all"):
            _print_micro(kind, variants)
        if args.mode in ("injected", "all"):
            print(f"### {kind}, injected: {args.rounds} rounds of {args.window:g} s windows, "
                  f"interleaved {', '.join(names)}\n")
            _print_table(summarize(measure(kind, variants, args.rounds, args.window)), per_round=True)
        if args.mode in ("inproc", "all"):
            print(f"### {kind}, in-process: {args.inproc_rounds} rounds of {args.inproc_window:g} s phases, "
                  f"order rotated each round\n")
            _print_table(summarize(measure_inproc(kind, variants, args.inproc_rounds, args.inproc_window)),
                         per_round=False)
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
