"""Overhead of stacklens vs torch.profiler on recognisable GPU workloads, attach-by-PID, one run.

    python benchmarks/gpu/bench_overhead.py --out DIR [--workloads resnet50,gpt2,vit,launch,jax]
        [--steps N] [--memory-s 120] [--memory-workload resnet50] [--deadline-s 420] [--cpu-smoke]

Per workload, ONE target process (tests/targets/gpu_workloads.py), phases in this order:
  unprofiled N steps → attach stacklens probes only (ProcessSession(agent=False)), N steps, detach
  → N steps (after-detach speed) → [probe variants, each followed by N unprofiled steps]
  → attach probes + agent (kernel records only, order join), N steps, detach → N steps
  → [memory phase: attach probes + agent, run for --memory-s, sample target RSS and profile size]
  → [probe-variant workloads: the agent with CUPTI API records (exact join), then N steps]
  → torch.profiler (CPU+CUDA) N steps → torch.profiler(with_stack=True) N steps.
JAX: unprofiled, probes, after-detach only (torch.profiler does not apply; the agent with --jax-agent).
Median step time per phase and ratio vs unprofiled; target RSS; stacklens snapshot size (gzip of
the JSON export) vs torch.profiler's exported chrome trace size. A phase that fails is recorded
with its error and the run goes on. Writes DIR/results.json and DIR/overhead.md after every
workload (so a run cut short still leaves what it measured).
Needs root (BPF) and `stacklens` importable. Never imports the gRPC service or generated protobuf code.
"""

from __future__ import annotations

import argparse
import datetime
import gzip
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests" / "targets"))

from gpu_control import PIN_ENV, Target, cpu_list, cpu_spec, rss_bytes  # noqa: E402

ALL = ("resnet50", "gpt2", "vit", "launch", "jax")
STEPS = {"resnet50": 40, "gpt2": 30, "vit": 120, "launch": 120, "jax": 100}  # ~1 s+ per phase
PLAIN = ("unprofiled", "after_detach", "after_detach_agent")  # + "plain_after_<phase>"
T0 = time.monotonic()


# probe variants (ProbeConfig fields): which part of the probes costs what on a workload
PROBE_VARIANTS = {
    "probes_no_pystacks": {"python_stacks": False},
    "probes_no_native": {"native_stacks": False},
    "probes_no_ops": {"ops": False},
    # the GPU API uprobes alone, no stacks, no operator probes: the floor of what the probes cost
    "probes_bare": {"python_stacks": False, "native_stacks": False, "ops": False},
}


# agent variants (agent settings, inject/agent DEFAULTS): which part of the agent costs what.
# Each is probes + an agent; against "probes" (probes alone) and "agent" (the default agent).
AGENT_VARIANTS = {
    "agent_no_gpu": {"gpu": False},           # the Python sampler alone
    "agent_no_sampler": {"sample_hz": 0.1},   # CUPTI alone (one sample every ~10 s)
    "agent_hz100": {"sample_hz": 100},        # the sampler at 100 Hz (the session gives 20 Hz when BPF reads Python stacks)
    "agent_copy": {"gpu_ref": False},         # CUPTI buffers copied and sent (before cupti_ref)
    # no cuptiActivityFlushAll(0) each second, CUPTI's own periodic flush only: it may return only
    # full buffers, so partly filled buffers then wait until they fill or until detach
    "agent_no_flush": {"gpu_flush": False},
    "agent_switch5": {"switch_s": 0.005},     # CPython's default GIL switch interval, not the bootstrap's 0.5 ms
}
SPLIT = ("agent_no_gpu", "agent_no_sampler", "agent_hz100", "agent_copy")   # --round-set split


def round_variant(key: str) -> tuple[bool, dict | None, dict | None]:
    """A round's extra configuration: (agent?, probe ProbeConfig fields, agent settings).
    Keys: AGENT_VARIANTS, PROBE_VARIANTS (probes alone), and agent_<x> for probes_<x> in
    PROBE_VARIANTS (the default agent over that probe variant)."""
    if key in AGENT_VARIANTS:
        return True, None, AGENT_VARIANTS[key]
    if key in PROBE_VARIANTS:
        return False, PROBE_VARIANTS[key], None
    if key.startswith("agent_") and "probes_" + key[6:] in PROBE_VARIANTS:
        return True, PROBE_VARIANTS["probes_" + key[6:]], None
    raise ValueError(f"unknown round variant {key!r}: one of {', '.join(AGENT_VARIANTS)}, "
                     f"{', '.join(PROBE_VARIANTS)}, or agent_<x> for probes_<x>")


def round_set(spec: str) -> list[str]:
    """--round-set: the variants each round runs after probes and agent (which always run).
    A comma list of: core (nothing more), split (the SPLIT variants), or variant keys (see
    round_variant); "split,agent_no_flush" = the SPLIT ones, then agent_no_flush. Duplicates
    are dropped (the first place counts); an unknown key raises ValueError."""
    keys: list[str] = []
    for k in (x.strip() for x in spec.split(",")):
        if not k or k == "core":
            continue
        if k == "split":
            keys += SPLIT
            continue
        round_variant(k)   # raises on an unknown key
        keys.append(k)
    return list(dict.fromkeys(keys))


# session stats kept with each memory sample (plus every drop/lost counter)
MEMORY_STATS = ("events", "launches", "cpu_samples", "agent_records", "kernels_joined", "kernels_unmatched",
                "launches_unmatched", "agent_samples", "agent_sample_hz", "agent_sample_cost_us")


def base_key(key: str) -> str:
    """Phase key without its round suffix ("agent@2" -> "agent")."""
    return key.split("@", 1)[0]


def log(msg: str) -> None:
    ts = datetime.datetime.now().strftime("%H:%M:%S")
    print(f"[{ts} +{time.monotonic() - T0:6.1f}s] {msg}", flush=True)


def err_text(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"[:1500]


# ---- stacklens side -----------------------------------------------------------------------


def profile_size(snap) -> dict:
    from stacklens.cct.export import to_json

    raw = json.dumps(to_json(snap), separators=(",", ":")).encode()
    return {"json_gz_bytes": len(gzip.compress(raw)), "json_bytes": len(raw), "nodes": snap.node_count}


def totals(snap) -> dict:
    return {m: snap.total(m) for m in snap.metrics if m not in snap.unavailable}


class Attached:
    """ProcessSession attach/detach with timings; start() runs under a watchdog."""

    def __init__(self, pid: int, agent: bool, timeout_s: float = 120.0, probe_kw: dict | None = None,
                 gpu_api_records: bool | None = None, agent_config: dict | None = None) -> None:
        from stacklens.daemon.session import ProcessSession

        kw = {}
        if probe_kw:  # a variant of the probes (which part costs what): ProbeConfig fields
            from stacklens.bpf import ProbeConfig, ProbeSession

            def factory(pid, *, cpu_hz, ops):
                return ProbeSession(pid, ProbeConfig(**{"cpu_sample_hz": cpu_hz, "ops": ops, **probe_kw}))
            kw["probe_factory"] = factory
        self.session = ProcessSession(pid, agent=agent, gpu_api_records=gpu_api_records,
                                      agent_config=agent_config, **kw)
        box: dict = {}

        def go():
            try:
                box["notes"] = self.session.start()
            except BaseException as e:  # noqa: BLE001
                box["error"] = e

        t = time.monotonic()
        th = threading.Thread(target=go, daemon=True)
        th.start()
        th.join(timeout_s)
        self.attach_s = time.monotonic() - t
        if th.is_alive():
            raise TimeoutError(f"ProcessSession.start() did not return within {timeout_s:.0f}s")
        if "error" in box:
            raise box["error"]
        self.notes = [str(n)[:300] for n in box.get("notes", [])]

    def measure(self) -> dict:
        """The session's stats while attached (never raises). The profile is read after detach
        (final_profile): the order join holds kernel records SETTLE_NS (3 s) before joining them,
        and the detach's forced drain joins the rest."""
        out: dict = {}
        try:
            out["stats"] = self.session.stats()
        except Exception as e:  # noqa: BLE001
            out["stats_error"] = err_text(e)
        return out

    def final_profile(self) -> dict:
        snap = self.session.snapshot()   # after stop(): read inline, the tree is final
        return {"profile": profile_size(snap), "totals": totals(snap), "unavailable": sorted(snap.unavailable)}

    def detach(self) -> float:
        t = time.monotonic()
        self.session.stop()
        return time.monotonic() - t


# ---- phases -------------------------------------------------------------------------------


class Runner:
    def __init__(self, args, out: Path, results: dict) -> None:
        self.a = args
        self.out = out
        self.results = results
        self.deadline = T0 + args.deadline_s

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def step_timeout(self, n: int, per_step: float | None) -> float:
        """Generous for a healthy target, bounded by what is left of the run (a hung target
        must not eat the whole budget)."""
        return min(max(60.0, 20.0 * n * (per_step or 0.1)), max(30.0, self.left() + 30.0))

    def run_steps(self, t: Target, n: int, per_step: float | None, cmd: str = "run") -> dict:
        rss0 = t.rss()
        ans = t.cmd(f"{cmd} {n}", timeout=self.step_timeout(n, per_step))
        ans["rss_before"] = rss0
        ans["rss_after"] = t.rss()
        return ans

    def workload(self, name: str) -> dict:
        a = self.a
        n = a.steps or (5 if a.cpu_smoke else STEPS[name])
        res: dict = {"workload": name, "steps": n, "phases": {}, "status": "ok"}
        ph = res["phases"]
        args = [name] + (["--cpu-smoke"] if a.cpu_smoke else [])
        # the target pins itself at its start (before importing torch): --pin-target's CPUs, or
        # with --pin-bench alone the bench's CPUs from before it pinned itself (not inherited ones)
        env = {PIN_ENV: a.target_cpus} if a.target_cpus else None
        log(f"{name}: starting target ({' '.join(args)})" + (f", {PIN_ENV}={a.target_cpus}" if env else ""))
        try:
            t = Target("gpu_workloads.py", args, env=env, stderr_path=self.out / f"{name}.stderr.log",
                       ready_timeout=max(60.0, min(600.0, self.left())))
        except Exception as e:  # noqa: BLE001
            res["status"] = f"failed: target did not start: {err_text(e)}"
            log(f"{name}: {res['status']}")
            return res
        res["target"] = t.info
        res["pid"] = t.pid
        if a.target_cpus:   # a check: all its threads should already be there (pinned from its start)
            res["target"].update(pin_process(t.pid, cpu_list(a.target_cpus)))
        log(f"{name}: ready pid {t.pid}: {t.info.get('impl')}")
        per_step: float | None = None
        dead = False

        def phase(key: str, fn, min_left: float = 20.0) -> None:
            nonlocal per_step, dead
            if dead:
                ph[key] = {"status": "skipped: target unresponsive or exited"}
                return
            if self.left() < min_left:
                ph[key] = {"status": f"skipped: deadline ({self.left():.0f}s left)"}
                log(f"{name}/{key}: {ph[key]['status']}")
                return
            t0 = time.monotonic()
            try:
                r = fn()
                r.setdefault("status", "ok")
            except Exception as e:  # noqa: BLE001
                r = {"status": f"failed: {err_text(e)}", "trace": traceback.format_exc()[-3000:]}
            r["phase_wall_s"] = round(time.monotonic() - t0, 3)
            ph[key] = r
            med = r.get("median_s")
            if key == "unprofiled" and med:
                per_step = med
            msg = f"median {med * 1e3:.3f} ms" if med else r["status"][:300]
            log(f"{name}/{key}: {msg} ({r['phase_wall_s']:.1f}s)")
            if not t.alive():
                dead = True
            elif r["status"] != "ok":
                try:
                    t.cmd("rss", timeout=20)
                except Exception:  # noqa: BLE001
                    dead = True
            if dead:
                log(f"{name}: target unresponsive or exited; skipping its remaining phases")

        def plain():
            return self.run_steps(t, n, per_step)

        def attached(agent: bool, probe_kw: dict | None = None, api_records: bool | None = None,
                     agent_config: dict | None = None):
            def fn():
                att = Attached(t.pid, agent=agent, probe_kw=probe_kw, gpu_api_records=api_records,
                               agent_config=agent_config)
                r: dict = {"attach_s": round(att.attach_s, 3), "notes": att.notes}
                try:
                    r.update(self.run_steps(t, n, per_step))
                    time.sleep(0.3)  # let the last events arrive
                    r.update(att.measure())
                finally:
                    r["detach_s"] = round(att.detach(), 3)
                    r["rss_after_detach"] = t.rss()
                try:
                    r.update(att.final_profile())
                except Exception as e:  # noqa: BLE001
                    r["measure_error"] = err_text(e)
                return r
            return fn

        def torchprof(stack: bool):
            return lambda: self._torchprof(t, n, per_step, stack)

        def memory():
            return self.memory(t, per_step)

        is_jax = name == "jax"
        variants = name in a.probe_variants.split(",")
        agent_ok = not is_jax or a.jax_agent
        phase("unprofiled", plain)
        res["target"]["maps_lines"] = maps_lines(t.pid)
        if name in a.agent_variants.split(",") and agent_ok:
            # the agent split into its parts, R interleaved rounds (the phases are ~1 s and the
            # machine drifts: one phase per configuration is too noisy to split a 10% cost)
            for r in range(1, a.rounds + 1):
                sfx = "" if r == 1 else f"@{r}"
                phase("probes" + sfx, attached(False))
                phase("after_detach" + sfx, plain)
                phase("agent" + sfx, attached(True))
                phase("after_detach_agent" + sfx, plain)
                for vkey in round_set(a.round_set):
                    agent, probe_kw, cfg = round_variant(vkey)
                    phase(vkey + sfx, attached(agent, probe_kw, agent_config=cfg))
                    phase("plain_after_" + vkey + sfx, plain)
            res["target"]["maps_lines_attached"] = maps_lines(t.pid)
            res["round_mode"] = a.round_set or "core"
            if not is_jax:  # last: Kineto leaves a cost behind (measured), see ratio_clean
                phase("torchprof", torchprof(False))
                phase("plain_after_torchprof", plain)
                phase("torchprof_stack", torchprof(True))
                phase("plain_after_torchprof_stack", plain)
            return self._finish(t, res, ph, dead)
        if a.memory_only:  # the long memory run alone (the device's calls last at most 10 minutes)
            phase("memory", memory, min_left=40.0)
            phase("after_detach_agent", plain)
            if not is_jax:
                phase("torchprof", torchprof(False))
            return self._finish(t, res, ph, dead)
        phase("probes", attached(False))
        phase("after_detach", plain)
        if variants:
            for vkey, kw in PROBE_VARIANTS.items():
                phase(vkey, attached(False, kw))
                phase("plain_after_" + vkey, plain)
        if agent_ok:
            phase("agent", attached(True))   # the default agent: kernel records only, order join
            phase("after_detach_agent", plain)
        else:
            ph["agent"] = {"status": "n/a: JAX is measured with probes only"}
        if name == a.memory_workload and a.memory_s > 0:
            phase("memory", memory, min_left=40.0)
        if agent_ok and variants:
            # the agent with CUPTI API records (exact join) last before torch.profiler: API tracing
            # leaves a cost behind in the process (measured), which would spoil later phases
            phase("agent_api_records", attached(True, api_records=True))
            phase("plain_after_agent_api_records", plain)
        if not is_jax:
            phase("torchprof", torchprof(False))
            phase("plain_after_torchprof", plain)
            phase("torchprof_stack", torchprof(True))
            phase("plain_after_torchprof_stack", plain)
        else:
            ph["torchprof"] = ph["torchprof_stack"] = {"status": "n/a: torch.profiler does not profile JAX"}
        return self._finish(t, res, ph, dead)

    def _finish(self, t, res, ph, dead) -> dict:
        rc = t.close(timeout=5.0 if dead else 30.0)
        res["target_rc"] = rc
        res["noise_tail"] = t.noise[-20:]
        base = ph.get("unprofiled", {}).get("median_s")
        for key, r in ph.items():
            if base and r.get("median_s"):
                r["ratio"] = r["median_s"] / base
        # drift-corrected ratio: against the mean of the unprofiled phases right before and after
        keys = list(ph)
        is_plain = [base_key(k) in PLAIN or k.startswith("plain_after_") for k in keys]
        for i, key in enumerate(keys):
            r = ph[key]
            if is_plain[i] or not r.get("median_s"):
                continue
            # the nearest unprofiled phase on each side (that measured something)
            near = [j for j in (next((j for j in range(i - 1, -1, -1) if is_plain[j]), None),
                                next((j for j in range(i + 1, len(keys)) if is_plain[j]), None))
                    if j is not None and ph[keys[j]].get("median_s")]
            if near:
                around = [ph[keys[j]]["median_s"] for j in near]
                r["ratio_local"] = r["median_s"] / (sum(around) / len(around))
                # the host part of a step (until step() returns), against the same phases
                host = [ph[keys[j]].get("host_median_s") for j in near]
                if all(host) and r.get("host_median_s"):
                    r["host_ratio_local"] = r["host_median_s"] / (sum(host) / len(host))
        # torch.profiler runs last and leaves a cost in the process (Kineto: 1.2-1.4x measured), so
        # the unprofiled phases after it are slow: its ratio against the clean ones before it
        clean, clean_host = [], []
        for i, key in enumerate(keys):
            if key.startswith("torchprof"):
                break
            if is_plain[i] and ph[key].get("median_s"):
                clean.append(ph[key]["median_s"])
                if ph[key].get("host_median_s"):
                    clean_host.append(ph[key]["host_median_s"])
        for key in keys:
            if not key.startswith("torchprof"):
                continue
            if clean and ph[key].get("median_s"):
                ph[key]["ratio_clean"] = ph[key]["median_s"] / statistics.median(clean)
            if clean_host and ph[key].get("host_median_s"):
                ph[key]["host_ratio_clean"] = ph[key]["host_median_s"] / statistics.median(clean_host)
        rounds: dict[str, list[float]] = {}
        for key, r in ph.items():
            x = r.get("ratio_clean") or r.get("ratio_local")
            if x:
                rounds.setdefault(base_key(key), []).append(x)
        if res.get("round_mode"):       # set by the agent-variants branch (also with --rounds 1)
            res["rounds"] = {k: {"ratios_local": [round(x, 4) for x in v], "median": statistics.median(v)}
                             for k, v in rounds.items()}
            # where a step's time went, per configuration (median over its rounds): wall, host
            # part (until step() returns), CPU of the main thread and of the whole process, per step
            split: dict[str, dict[str, list[float]]] = {}
            for key, r in ph.items():
                n = r.get("n") or 0
                if not r.get("median_s") or not n or key.startswith("plain_after_torchprof"):
                    continue   # (Kineto leaves a cost behind: the phases after it are not clean)
                d = split.setdefault(base_key(key) if not key.startswith("plain_after_") and
                                     base_key(key) not in PLAIN else "unprofiled", {})
                d.setdefault("step_ms", []).append(r["median_s"] * 1e3)
                if r.get("host_median_s"):
                    d.setdefault("host_ms", []).append(r["host_median_s"] * 1e3)
                if r.get("cpu_main_s") is not None:
                    d.setdefault("cpu_main_ms", []).append(r["cpu_main_s"] / n * 1e3)
                    d.setdefault("cpu_process_ms", []).append(r["cpu_process_s"] / n * 1e3)
                hr = r.get("host_ratio_clean") or r.get("host_ratio_local")   # as the step ratio
                if hr:
                    d.setdefault("host_ratio", []).append(hr)
            res["step_split"] = {k: {m: round(statistics.median(v), 4) for m, v in d.items()}
                                 for k, d in split.items()}
        mem = ph.get("memory", {})
        tp = ph.get("torchprof", {})
        if mem.get("steps") and tp.get("trace_bytes") and tp.get("n"):
            mem["torchprof_trace_bytes_same_steps_est"] = int(tp["trace_bytes"] / tp["n"] * mem["steps"])
        return res

    def _torchprof(self, t: Target, n: int, per_step: float | None, stack: bool) -> dict:
        rss0 = t.rss()
        cmd = f"torchprof {n}" + (" stack" if stack else "")
        ans = t.cmd(cmd, timeout=self.step_timeout(n, per_step) + 120)  # + the trace export
        ans["rss_before"] = rss0
        ans["rss_after"] = t.rss()
        return ans

    def memory(self, t: Target, per_step: float | None) -> dict:
        """Target RSS and profile size over time with stacklens (probes + agent) attached."""
        a = self.a
        duration = min(a.memory_s, max(10.0, self.left() - (20.0 if a.memory_only else 60.0)))
        chunk = max(1, int(a.memory_interval_s / (per_step or 0.05)))
        rss_pre = t.rss()
        agent_error = None
        if a.memory_probes_only:
            att = Attached(t.pid, agent=False)
        else:
            try:
                att = Attached(t.pid, agent=True)
            except Exception as e:  # noqa: BLE001 — still measure memory with the probes alone
                agent_error = err_text(e)
                log(f"memory: agent attach failed ({agent_error[:200]}); probes only")
                att = Attached(t.pid, agent=False)
        r: dict = {"duration_s_requested": a.memory_s, "duration_s": round(duration, 1),
                   "agent": att.session.want_agent, "attach_s": round(att.attach_s, 3),
                   "notes": att.notes, "rss_before_attach": rss_pre, "samples": [], "steps": 0}
        if agent_error:
            r["agent_error"] = agent_error
        try:
            t0 = time.monotonic()
            while time.monotonic() - t0 < duration:
                ans = t.cmd(f"run {chunk}", timeout=self.step_timeout(chunk, per_step))
                r["steps"] += chunk
                s = {"t_s": round(time.monotonic() - t0, 2), "steps": r["steps"], "rss": t.rss(),
                     "daemon_rss": rss_bytes(os.getpid()), "median_s": ans.get("median_s")}
                try:
                    s.update(profile_size(att.session.snapshot()))
                    # what a user looks at (TUI, /metrics, `report --window`): the last minute
                    s["window60"] = profile_size(att.session.snapshot(window_s=60.0))
                    st = att.session.stats()
                    s["stats"] = {k: v for k, v in st.items() if k in MEMORY_STATS or "drop" in k or "lost" in k}
                except Exception as e:  # noqa: BLE001
                    s["snapshot_error"] = err_text(e)
                s["daemon_cpu_s"] = round(sum(os.times()[:2]), 2)
                r["samples"].append(s)
                log(f"memory: t={s['t_s']}s steps={s['steps']} rss={s['rss'] / 2**20:.1f} MiB "
                    f"profile={s.get('json_gz_bytes', 0) / 1024:.1f} KiB gz, {s.get('nodes')} nodes, "
                    f"last 60 s {s.get('window60', {}).get('json_gz_bytes', 0) / 1024:.1f} KiB gz, "
                    f"daemon cpu {s['daemon_cpu_s']} s")
                (self.out / "memory_partial.json").write_text(json.dumps(r, default=str))  # if cut short
            r.update(att.measure())
        finally:
            r["detach_s"] = round(att.detach(), 3)
            r["rss_after_detach"] = t.rss()
        try:
            r.update(att.final_profile())
        except Exception as e:  # noqa: BLE001
            r["measure_error"] = err_text(e)
        smp = r["samples"]
        if smp:
            first = smp[0]["rss"]
            r["rss_growth_frac"] = (smp[-1]["rss"] - first) / first if first else None
            r["rss_growth_vs_pre_attach_frac"] = (smp[-1]["rss"] - rss_pre) / rss_pre if rss_pre else None
            w60 = [x["window60"]["json_gz_bytes"] for x in smp if x.get("window60")]
            if w60:
                r["window60_gz_first"], r["window60_gz_last"], r["window60_gz_max"] = w60[0], w60[-1], max(w60)
            sizes = [x.get("json_gz_bytes") for x in smp if x.get("json_gz_bytes")]
            if sizes:
                r["profile_gz_first"], r["profile_gz_last"], r["profile_gz_max"] = sizes[0], sizes[-1], max(sizes)
        return r


# ---- report -------------------------------------------------------------------------------


def maps_lines(pid: int) -> int | None:
    """How many mappings the target has (what reading /proc/PID/maps costs scales with)."""
    try:
        with open(f"/proc/{pid}/maps", "rb") as fh:
            return sum(1 for _ in fh)
    except OSError:
        return None


def pin_process(pid: int, cpus: set[int]) -> dict:
    """Every thread of pid on these CPUs (threads it creates later inherit). The target pinned
    itself at its start, so this is a check (how many threads were already there) that also moves
    any thread that was not (e.g. one a library started with its own affinity)."""
    n = already = 0
    tids = os.listdir(f"/proc/{pid}/task")
    for tid in tids:
        try:
            if os.sched_getaffinity(int(tid)) == cpus:
                already += 1
            os.sched_setaffinity(int(tid), cpus)
            n += 1
        except (ProcessLookupError, FileNotFoundError):
            pass   # a thread that just exited
    return {"threads": len(tids), "threads_on_cpus_before_pin": already, "pinned_threads": n}


def cpu_topology() -> dict:
    """cpu -> its SMT siblings (sysfs), to read what --pin-* shared"""
    out = {}
    for d in sorted(Path("/sys/devices/system/cpu").glob("cpu[0-9]*")):
        try:
            out[d.name] = (d / "topology" / "thread_siblings_list").read_text().strip()
        except OSError:
            pass
    return out


CODE_DIRS = ("bpf", "inject", "daemon", "cct", "analyzer", "tui", "benchmarks", "tests/targets")


def tree_hash() -> str:
    """sha256 over the code that runs (paths and contents of *.py, *.c, *.h, *.toml, *.sh under
    CODE_DIRS and the root's *.py), 16 hex digits."""
    import hashlib

    h = hashlib.sha256()
    files = sorted(p for d in CODE_DIRS for p in (REPO / d).rglob("*")
                   if p.is_file() and p.suffix in (".py", ".c", ".h", ".toml", ".sh")
                   and "__pycache__" not in p.parts)
    for p in sorted(REPO.glob("*.py")) + files:
        h.update(str(p.relative_to(REPO)).encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def environment(args) -> dict:
    env = {"started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "host": platform.node(), "kernel": platform.release(), "python": sys.version.split()[0],
           "argv": sys.argv, "cpu_smoke": args.cpu_smoke, "cpus": os.cpu_count(),
           "session": "ProcessSession(pid, agent=False|True) defaults: cpu_hz=99, ops=True",
           "pin_target": args.pin_target, "pin_bench": args.pin_bench,
           "bench_cpus_before_pin": args.bench_cpus, "target_cpus": args.target_cpus,
           "cpu_siblings": cpu_topology()}
    if shutil.which("nvidia-smi"):
        try:
            env["nvidia_smi"] = subprocess.run(
                ["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.max.sm",
                 "--format=csv,noheader"], capture_output=True, text=True, timeout=20).stdout.strip()
        except Exception as e:  # noqa: BLE001
            env["nvidia_smi"] = err_text(e)
    try:
        env["stacklens_commit"] = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
                                                 capture_output=True, text=True, timeout=10).stdout.strip() or None
    except Exception:  # noqa: BLE001
        env["stacklens_commit"] = None
    # the device's copy of the tree can carry a stale .git (its HEAD is not what ran): a hash of the
    # code itself says which commit ran (`python benchmarks/gpu/bench_overhead.py --tree-hash` at a
    # checkout gives the same value)
    env["stacklens_tree_hash"] = tree_hash()
    try:
        import stacklens

        env["stacklens"] = getattr(stacklens, "__version__", "?")
        env["stacklens_path"] = os.path.dirname(stacklens.__file__)
    except Exception as e:  # noqa: BLE001
        env["stacklens"] = f"not importable: {err_text(e)}"
    return env


def fmt_ms(r: dict) -> str:
    return f"{r['median_s'] * 1e3:.2f}" if r.get("median_s") else "—"


def fmt_ratio(r: dict | None) -> str:
    if not r:
        return "—"
    if r.get("ratio"):
        if r.get("ratio_local"):  # drift-corrected (unprofiled phases right before/after) first
            return f"{r['ratio_local']:.3f}× ({r['ratio']:.3f}×)"
        return f"{r['ratio']:.3f}×"
    st = r.get("status", "")
    if st.startswith("n/a"):
        return "n/a"
    if st.startswith("skipped"):
        return "skipped"
    return "FAILED" if st.startswith("failed") else "—"


def mib(b) -> str:
    return f"{b / 2**20:.1f}" if b else "—"


def kib(b) -> str:
    return f"{b / 1024:.1f}" if b else "—"


def markdown(results: dict) -> str:
    env = results["environment"]
    lines = ["# stacklens GPU overhead — raw results", "",
             f"- started: {env.get('started')}, host {env.get('host')}, kernel {env.get('kernel')}, "
             f"Python {env.get('python')}, {env.get('cpus')} CPUs",
             f"- GPU: {env.get('nvidia_smi', 'none')}",
             f"- stacklens commit: {env.get('stacklens_commit')}; cpu_smoke: {env.get('cpu_smoke')}",
             f"- command: `{' '.join(env.get('argv', []))}`", ""]
    lines += ["| workload | steps | unprofiled ms/step | probes only | after detach | probes + agent | "
              "after detach (agent) | torch.profiler | torch.profiler + stack |",
              "|---|---|---|---|---|---|---|---|---|"]
    for w in results["workloads"]:
        ph = w.get("phases", {})
        lines.append(f"| {w['workload']} | {w.get('steps')} | {fmt_ms(ph.get('unprofiled', {}))} | "
                     f"{fmt_ratio(ph.get('probes'))} | {fmt_ratio(ph.get('after_detach'))} | "
                     f"{fmt_ratio(ph.get('agent'))} | {fmt_ratio(ph.get('after_detach_agent'))} | "
                     f"{fmt_ratio(ph.get('torchprof'))} | {fmt_ratio(ph.get('torchprof_stack'))} |")
    variants = [w for w in results["workloads"] if any(k in w.get("phases", {}) for k in PROBE_VARIANTS)]
    if variants:
        lines += ["", "Probe variants (probes only, one part switched off; same process, same run):", "",
                  "| workload | all probes | " + " | ".join(PROBE_VARIANTS) + " | agent (order join) | agent, API records |",
                  "|---|---|" + "---|" * (len(PROBE_VARIANTS) + 2)]
        for w in variants:
            ph = w["phases"]
            lines.append(f"| {w['workload']} | {fmt_ratio(ph.get('probes'))} | "
                         + " | ".join(fmt_ratio(ph.get(k)) for k in PROBE_VARIANTS)
                         + f" | {fmt_ratio(ph.get('agent'))} | {fmt_ratio(ph.get('agent_api_records'))} |")
    multi = [w for w in results["workloads"] if w.get("rounds")]
    if multi:
        keys = ["probes", "agent"]
        for w in multi:
            keys += [k for k in w["rounds"] if k not in keys and not k.startswith("torchprof")]
        keys += ["torchprof", "torchprof_stack"]
        lines += ["", "Interleaved rounds (drift-corrected ratios; median, then each round; torch.profiler, "
                  "run once at the end, against the median of the unprofiled phases before it):", "",
                  "| workload | maps lines | " + " | ".join(keys) + " |", "|---|---|" + "---|" * len(keys)]
        for w in multi:
            rd = w["rounds"]
            cells = []
            for k in keys:
                x = rd.get(k)
                cells.append("—" if not x else f"**{x['median']:.3f}×** ("
                             + ", ".join(f"{v:.3f}" for v in x["ratios_local"]) + ")")
            tg = w.get("target") or {}
            lines.append(f"| {w['workload']} | {tg.get('maps_lines')}/{tg.get('maps_lines_attached')} | "
                         + " | ".join(cells) + " |")
    splits = [w for w in results["workloads"] if w.get("step_split")]
    if splits:
        lines += ["", "Where a step's time went (median over rounds; host = until step() returns, before the "
                  "device sync; CPU per step of the main thread and of the whole process):", "",
                  "| workload | configuration | step ms | host ms | host ratio | main-thread CPU ms | process CPU ms |",
                  "|---|---|---|---|---|---|---|"]
        for w in splits:
            for k, d in w["step_split"].items():
                cell = lambda m, f="{:.2f}": f.format(d[m]) if m in d else "—"  # noqa: E731
                lines.append(f"| {w['workload']} | {k} | {cell('step_ms')} | {cell('host_ms')} | "
                             f"{cell('host_ratio', '{:.3f}×')} | {cell('cpu_main_ms')} | {cell('cpu_process_ms')} |")
    lines += ["", "Ratios are median step time over the unprofiled median, same process, same run; for "
              "attached phases the first number is against the mean of the unprofiled phases right before "
              "and after it (drift-corrected), the one in parentheses against the first unprofiled phase.", "",
              "| workload | RSS start MiB | RSS end MiB | stacklens profile probes (gz KiB) | "
              "stacklens profile agent (gz KiB) | torch.profiler trace MiB | trace + stack MiB | "
              "attach s (probes/agent) | detach s (probes/agent) |",
              "|---|---|---|---|---|---|---|---|---|"]
    for w in results["workloads"]:
        ph = w.get("phases", {})
        first = ph.get("unprofiled", {}).get("rss_before") or (w.get("target") or {}).get("rss_bytes")
        last = None
        for r in ph.values():
            last = r.get("rss_after_detach") or r.get("rss_after") or last
        pr, ag = ph.get("probes", {}), ph.get("agent", {})
        lines.append(
            f"| {w['workload']} | {mib(first)} | {mib(last)} | "
            f"{kib(pr.get('profile', {}).get('json_gz_bytes'))} | {kib(ag.get('profile', {}).get('json_gz_bytes'))} | "
            f"{mib(ph.get('torchprof', {}).get('trace_bytes'))} | {mib(ph.get('torchprof_stack', {}).get('trace_bytes'))} | "
            f"{pr.get('attach_s', '—')} / {ag.get('attach_s', '—')} | {pr.get('detach_s', '—')} / {ag.get('detach_s', '—')} |")
    gpu = bool(env.get("nvidia_smi")) and not env.get("cpu_smoke")
    for w in results["workloads"]:
        for key in ("torchprof", "torchprof_stack"):
            r = w.get("phases", {}).get(key, {})
            if gpu and r.get("status") == "ok" and not r.get("trace_kernel_events"):
                lines += ["", f"**Warning: {w['workload']} / {key}: torch.profiler recorded no GPU kernel "
                          "events (CUPTI left unusable after stacklens detached?)**"]
    for w in results["workloads"]:
        mem = w.get("phases", {}).get("memory")
        if not mem:
            continue
        lines += ["", f"## Memory phase: {w['workload']} ({mem.get('status')})", ""]
        if mem.get("samples"):
            g = mem.get("rss_growth_frac")
            g2 = mem.get("rss_growth_vs_pre_attach_frac")
            lines += [f"- duration {mem.get('duration_s')} s (requested {mem.get('duration_s_requested')} s), "
                      f"{mem.get('steps')} steps, agent: {mem.get('agent')}"
                      + (f" (agent attach failed: {mem['agent_error'][:200]})" if mem.get("agent_error") else ""),
                      f"- target RSS: {mib(mem.get('rss_before_attach'))} MiB before attach, "
                      f"{mib(mem['samples'][0]['rss'])} → {mib(mem['samples'][-1]['rss'])} MiB while attached "
                      f"(growth {g * 100:.2f}% from the first sample"
                      + (f", {g2 * 100:.2f}% from before attach" if g2 is not None else "") + "), "
                      f"{mib(mem.get('rss_after_detach'))} MiB after detach",
                      f"- stacklens profile (gzip JSON): {kib(mem.get('profile_gz_first'))} → "
                      f"{kib(mem.get('profile_gz_last'))} KiB (max {kib(mem.get('profile_gz_max'))})",
                      f"- torch.profiler trace for the same number of steps (estimated from its per-step size): "
                      f"{mib(mem.get('torchprof_trace_bytes_same_steps_est'))} MiB",
                      f"- last 60 s window (what the TUI and /metrics show): {kib(mem.get('window60_gz_first'))} → "
                      f"{kib(mem.get('window60_gz_last'))} KiB (max {kib(mem.get('window60_gz_max'))})", "",
                      "| t s | steps | target RSS MiB | median ms/step | profile gz KiB | nodes | last 60 s gz KiB "
                      "| last 60 s nodes | daemon (bench) RSS MiB | bench process CPU s (daemon + snapshots) | kernels joined | drops |",
                      "|---|---|---|---|---|---|---|---|---|---|---|---|"]
            for s in mem["samples"]:
                med = f"{s['median_s'] * 1e3:.2f}" if s.get("median_s") else "—"
                win = s.get("window60") or {}
                st = s.get("stats") or {}
                drops = sum(v for k, v in st.items() if ("drop" in k or "lost" in k) and isinstance(v, int))
                lines.append(f"| {s['t_s']} | {s['steps']} | {mib(s['rss'])} | {med} | {kib(s.get('json_gz_bytes'))} | "
                             f"{s.get('nodes', '—')} | {kib(win.get('json_gz_bytes'))} | {win.get('nodes', '—')} | "
                             f"{mib(s.get('daemon_rss'))} | {s.get('daemon_cpu_s', '—')} | "
                             f"{st.get('kernels_joined', '—')} | {drops} |")
    fails = [(w["workload"], k, r["status"]) for w in results["workloads"]
             for k, r in w.get("phases", {}).items() if str(r.get("status", "ok")) != "ok"]
    fails += [(w["workload"], "target", w["status"]) for w in results["workloads"] if w.get("status") != "ok"]
    if fails:
        lines += ["", "## Phases not measured", ""]
        lines += [f"- {w} / {k}: {s[:400]}" for w, k, s in fails]
    notes = [(w["workload"], k, n) for w in results["workloads"] for k, r in w.get("phases", {}).items()
             for n in r.get("notes", [])[:6]]
    if notes:
        lines += ["", "## Attach notes", ""]
        seen = set()
        for w, k, n in notes:
            if (k, n) not in seen:
                seen.add((k, n))
                lines.append(f"- {w} / {k}: {n}")
    lines += ["", "## Workloads", ""]
    lines += [f"- {w['workload']}: {(w.get('target') or {}).get('impl', w.get('status'))}" for w in results["workloads"]]
    return "\n".join(lines) + "\n"


def write(out: Path, results: dict) -> None:
    (out / "results.json").write_text(json.dumps(results, indent=1, default=str))
    (out / "overhead.md").write_text(markdown(results))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="results folder (required unless --tree-hash)")
    ap.add_argument("--workloads", default=",".join(ALL))
    ap.add_argument("--steps", type=int, default=0, help="steps per phase (default: per workload)")
    ap.add_argument("--memory-s", type=float, default=120.0, help="memory phase length (the issue asks 600)")
    ap.add_argument("--memory-interval-s", type=float, default=10.0)
    ap.add_argument("--memory-workload", default="resnet50")
    ap.add_argument("--memory-probes-only", action="store_true", help="memory phase without the agent")
    ap.add_argument("--memory-only", action="store_true",
                    help="per workload: unprofiled, the memory phase, after detach, torch.profiler's trace size")
    ap.add_argument("--probe-variants", default="",
                    help="workloads (comma list) that also run the probe variants " + ", ".join(PROBE_VARIANTS))
    ap.add_argument("--jax-agent", action="store_true", help="also run the agent phase on JAX")
    ap.add_argument("--agent-variants", default="",
                    help="workloads (comma list) measured as interleaved rounds of probes / agent / "
                         "the --round-set variants (then torch.profiler once)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds for --agent-variants")
    ap.add_argument("--round-set", default="split",
                    help="what each round runs after probes and agent, a comma list of: core (nothing "
                         "more), split (" + ", ".join(SPLIT) + "), or variants (" + ", ".join(AGENT_VARIANTS)
                         + ", " + ", ".join(PROBE_VARIANTS) + ", agent_<x> for probes_<x>); "
                         "e.g. split,agent_no_flush")
    ap.add_argument("--pin-target", default=None,
                    help="CPU list for every thread of each target (e.g. 4-7), from the target's start")
    ap.add_argument("--pin-bench", default=None,
                    help="CPU list for this process (the daemon side), e.g. 8-15; without --pin-target "
                         "the targets keep the CPUs this process had before")
    ap.add_argument("--deadline-s", type=float, default=3600.0, help="skip phases that would start after this")
    ap.add_argument("--tree-hash", action="store_true", help="print the code's hash (recorded in results) and exit")
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny CPU sizes (harness test without a GPU)")
    a = ap.parse_args(argv)
    if a.tree_hash:
        print(tree_hash())
        return 0
    if not a.out:
        ap.error("--out is required")
    try:
        round_set(a.round_set)
    except ValueError as e:
        ap.error(str(e))
    allowed = os.sched_getaffinity(0)   # before the bench pins itself
    pins: dict[str, set[int]] = {}
    for opt, spec in (("--pin-target", a.pin_target), ("--pin-bench", a.pin_bench)):
        if spec is None:
            continue
        try:
            cpus = cpu_list(spec)   # an empty or malformed list is an error
        except ValueError as e:
            ap.error(f"{opt}: {e}")
        if not cpus <= allowed:
            ap.error(f"{opt} {spec}: CPUs {cpu_spec(cpus - allowed)} are not among this process's "
                     f"CPUs ({cpu_spec(allowed)})")
        pins[opt] = cpus
    a.bench_cpus = cpu_spec(allowed)
    # what each target pins itself to at its start: --pin-target, or with --pin-bench alone the
    # CPUs the bench had before pinning (else the targets would inherit the bench's pinning)
    a.target_cpus = (cpu_spec(pins["--pin-target"]) if "--pin-target" in pins
                     else a.bench_cpus if "--pin-bench" in pins else "")
    if "--pin-bench" in pins:
        os.sched_setaffinity(0, pins["--pin-bench"])   # threads started from here on inherit it
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        log("warning: not root: the stacklens phases will fail (BPF needs root)")
    results = {"environment": environment(a), "workloads": [], "bench_rss_bytes": None}
    write(out, results)
    runner = Runner(a, out, results)
    names = [w.strip() for w in a.workloads.split(",") if w.strip()]
    if a.memory_workload in names and a.memory_s > 0:  # last, so its length is what time is left
        names = [w for w in names if w != a.memory_workload] + [a.memory_workload]
    for name in names:
        if name not in ALL:
            results["workloads"].append({"workload": name, "status": "failed: unknown workload", "phases": {}})
            continue
        if runner.left() < 45:
            results["workloads"].append({"workload": name, "phases": {},
                                         "status": f"skipped: deadline ({runner.left():.0f}s left)"})
            log(f"{name}: skipped (deadline)")
            continue
        try:
            results["workloads"].append(runner.workload(name))
        except Exception as e:  # noqa: BLE001
            results["workloads"].append({"workload": name, "phases": {}, "status": f"failed: {err_text(e)}",
                                         "trace": traceback.format_exc()[-3000:]})
        results["bench_rss_bytes"] = rss_bytes(os.getpid())
        write(out, results)
    results["finished_after_s"] = round(time.monotonic() - T0, 1)
    write(out, results)
    log(f"wrote {out / 'overhead.md'} and {out / 'results.json'}")
    sys.stdout.write(markdown(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
