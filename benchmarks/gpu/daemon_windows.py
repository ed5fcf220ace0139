"""Issue 41 acceptance 1 and 2 on the GPU machine: windows through stacklensd against one-shot
windows, and a held decode session against torch.profiler.

    bash benchmarks/gpu/daemon_windows.sh          (the device: carry [".device"]; results under $OUT)
    python benchmarks/gpu/daemon_windows.py --out DIR [--runs 3] [--durations 4,15]

1. Three targets side by side (tests/targets/safety_workloads.py: compile_default, cuda_graph,
   jax with default XLA flags), one stacklensd. Per target, `--runs` rounds of: a window through
   the daemon and a `--no-daemon` window, both `profile --agent -f json`, for each duration. Row:
   GPU time, kernels, launches, the window's account and notes. A round pairs the two windows of
   one length back to back on the same process; the ratio daemon / one-shot is per round. At
   most one window through the daemon and one one-shot window run at a time (run 36 profiled all
   three at once: the machine's profilers were overloaded and dropped events).
2. Batch-1 decoding of a GPT-2-shaped causal LM (tests/gpu/decode_window.py), alone on the GPU:
   `attach --agent`, 20 s, `report -f json`: the share of GPU time with no Python frame on its
   path, the session's join counters (why GPU time lacks a line, where it does); then the target
   profiles N episodes with torch.profiler: per-kernel counts (as shares of all kernels) and mean
   durations against the held session's.
Writes DIR/daemon_windows.json and DIR/daemon_windows.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
WORKLOADS = REPO / "tests" / "targets" / "safety_workloads.py"
DECODE = REPO / "tests" / "gpu" / "decode_window.py"
CLI = [sys.executable, "-m", "stacklens.cli.main"]
T0 = time.monotonic()


def log(msg: str) -> None:
    print(f"[+{time.monotonic() - T0:6.1f}s] {msg}", flush=True)


def load(text: str):
    from stacklens.cct import export

    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        f.write(text)
    try:
        return export.load(f.name)
    finally:
        os.unlink(f.name)


def summary(snap) -> dict:
    gpu = None if "gpu_time_ns" in snap.unavailable else snap.total("gpu_time_ns")
    no_line = 0
    for path, v in snap.iter_paths():
        if v.get("gpu_time_ns") and not any(f.kind == "python" for f in path):
            no_line += v["gpu_time_ns"]
    w = snap.meta.get("window") or {}
    return {"gpu_ms": None if gpu is None else round(gpu / 1e6, 1),
            "no_line_share": round(no_line / gpu, 4) if gpu else None,
            "kernels": None if "kernel_count" in snap.unavailable else snap.total("kernel_count"),
            "launches": snap.total("launch_count"), "seconds": round(w.get("seconds", 0), 3),
            "drained": w.get("drained"), "notes": [n[:200] for n in snap.meta.get("notes", [])][-6:]}


def window(sock: str, pid: int, duration: float, daemon: bool) -> dict:
    t0 = time.monotonic()
    r = subprocess.run([*CLI, "--socket", sock, "profile", "-p", str(pid), "-d", str(duration), "--agent", "-f", "json",
                        *([] if daemon else ["--no-daemon"])], capture_output=True, text=True, timeout=300)
    row = {"through": "daemon" if daemon else "one-shot", "duration": duration, "rc": r.returncode,
           "wall_s": round(time.monotonic() - t0, 1)}
    if r.returncode != 0:
        row["stderr"] = r.stderr[-600:]
        return row
    row.update(summary(load(r.stdout)))
    return row


def part1(sock: str, a, out: Path, rows: list) -> None:
    targets = {}
    for w in a.workloads.split(","):
        t = subprocess.Popen([sys.executable, str(WORKLOADS), w, "--device", a.device, "--log", str(out / f"ep-{w}.jsonl")],
                             stdout=subprocess.PIPE, stderr=open(out / f"stderr-{w}.log", "wb"), text=True)
        targets[w] = t
    try:
        for w, t in targets.items():
            for line in t.stdout:
                if line.strip() == "ready":
                    break
            log(f"{w} ready (pid {t.pid})")

        lanes = {True: threading.Lock(), False: threading.Lock()}   # one window of each kind at a time

        def rounds(w: str, t) -> None:
            for i in range(a.runs):
                for d in a.durations:
                    for daemon in (True, False):
                        if time.monotonic() > a.part1_deadline:
                            return
                        try:
                            with lanes[daemon]:
                                row = window(sock, t.pid, d, daemon)
                        except Exception as e:  # noqa: BLE001 - kept as the row
                            row = {"error": f"{type(e).__name__}: {e}"[:300]}
                        row.update(workload=w, round=i)
                        rows.append(row)
                        log(json.dumps(row)[:300])

        threads = [threading.Thread(target=rounds, args=(w, t)) for w, t in targets.items()]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
    finally:
        for t in targets.values():
            t.terminate()
        for t in targets.values():
            try:
                t.wait(30)
            except subprocess.TimeoutExpired:
                t.kill()


def part2(sock: str, a, out: Path) -> dict:
    cmd = out / "decode.cmd"
    t = subprocess.Popen([sys.executable, str(DECODE), "--cmd", str(cmd), "--out", str(out), "--device", a.device],
                         stdout=subprocess.PIPE,
                         stderr=open(out / "stderr-decode.log", "wb"), text=True)
    res: dict = {}
    try:
        res["model"] = t.stdout.readline().split()[1:]
        log(f"decode ready {res['model']} (pid {t.pid})")
        r = subprocess.run([*CLI, "--socket", sock, "attach", "--agent", str(t.pid)], capture_output=True, text=True,
                           timeout=300)
        res["attach_rc"] = r.returncode
        time.sleep(a.decode_s)
        r = subprocess.run([*CLI, "--socket", sock, "report", str(t.pid), "-f", "json"], capture_output=True,
                           text=True, timeout=300)
        snap = load(r.stdout)
        (out / "decode-held.json").write_text(r.stdout)
        res["held"] = summary(snap)
        stats = subprocess.run([*CLI, "--socket", sock, "ps", "--json"], capture_output=True, text=True, timeout=60)
        res["ps"] = [p for p in json.loads(stats.stdout)["processes"] if p["pid"] == t.pid]
        from stacklens.daemon.client import DaemonClient

        with DaemonClient(sock) as c:
            res["session_stats"] = dict(c.snapshot_response(t.pid, depth=1).stats)
        subprocess.run([*CLI, "--socket", sock, "detach", str(t.pid)], capture_output=True, timeout=300)
        seen: dict[str, list[int]] = {}
        for path, v in snap.iter_paths():
            if v.get("kernel_count") and path and path[-1].kind == "kernel":
                k = seen.setdefault(path[-1].name, [0, 0])
                k[0] += v["kernel_count"]
                k[1] += v.get("gpu_time_ns", 0)
        cmd.write_text(f"profile {a.profile_episodes}\n")
        line = t.stdout.readline().strip()
        truth = json.loads((out / "torch_profiler.json").read_text()) if line == "profiled" else {}
        res["compare"] = compare(seen, truth.get("kernels", {}))
    finally:
        t.terminate()
        try:
            t.wait(30)
        except subprocess.TimeoutExpired:
            t.kill()
    return res


def compare(seen: dict, truth: dict) -> dict:
    """Per kernel name present in both: count share and mean duration, stacklens vs torch.profiler."""
    common = sorted(set(seen) & set(truth), key=lambda k: -truth[k][1])
    n_s = sum(seen[k][0] for k in common) or 1
    n_t = sum(truth[k][0] for k in common) or 1
    rows = []
    for k in common:
        cs, ct = seen[k][0] / n_s, truth[k][0] / n_t
        ms, mt = seen[k][1] / max(1, seen[k][0]), truth[k][1] / max(1, truth[k][0])
        rows.append({"kernel": k[:90], "count_share": [round(cs, 5), round(ct, 5)],
                     "count_share_rel": round(cs / ct - 1, 4) if ct else None,
                     "mean_ns": [round(ms), round(mt)], "mean_rel": round(ms / mt - 1, 4) if mt else None})
    gpu_common_s = sum(seen[k][1] for k in common)
    return {"kernels_common": len(common), "only_stacklens": len(set(seen) - set(truth)),
            "only_torch": len(set(truth) - set(seen)),
            "gpu_share_in_common": round(gpu_common_s / max(1, sum(v[1] for v in seen.values())), 4),
            "worst_count_share_rel": max((abs(r["count_share_rel"] or 0) for r in rows), default=None),
            "worst_mean_rel_top10": max((abs(r["mean_rel"] or 0) for r in rows[:10]), default=None),
            "rows": rows[:40]}


def table(rows: list) -> list[str]:
    md = ["| workload | round | duration s | daemon GPU ms | one-shot GPU ms | ratio | daemon drained | notes (daemon) |",
          "|---|---|---|---|---|---|---|---|"]
    by = {}
    for r in rows:
        by.setdefault((r.get("workload"), r.get("round"), r.get("duration")), {})[r.get("through")] = r
    ratios: dict = {}
    for (w, i, d), pair in sorted(by.items(), key=lambda x: (str(x[0][0]), x[0][2] or 0, x[0][1] or 0)):
        dm, os_ = pair.get("daemon", {}), pair.get("one-shot", {})
        ratio = (dm.get("gpu_ms") or 0) / os_["gpu_ms"] if os_.get("gpu_ms") else None
        if ratio is not None:
            ratios.setdefault((w, d), []).append(ratio)
        md.append(f"| {w} | {i} | {d} | {dm.get('gpu_ms')} | {os_.get('gpu_ms')} | "
                  f"{'n/a' if ratio is None else f'{ratio:.3f}'} | {dm.get('drained')} | "
                  f"{'; '.join(dm.get('notes', [])[-2:])[:160]} |")
    md += ["", "| workload | duration s | median ratio | min | max |", "|---|---|---|---|---|"]
    for (w, d), rs in sorted(ratios.items(), key=lambda x: (str(x[0][0]), x[0][1])):
        md.append(f"| {w} | {d} | {statistics.median(rs):.3f} | {min(rs):.3f} | {max(rs):.3f} |")
    return md


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--workloads", default="compile_default,cuda_graph,jax")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--durations", default="4,15")
    ap.add_argument("--decode-s", type=float, default=20.0)
    ap.add_argument("--profile-episodes", type=int, default=20)
    ap.add_argument("--part1-s", type=float, default=300.0, help="no new window after this long")
    ap.add_argument("--skip", default="", help="part1, part2")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="part 1's (cpu: a dry run of the harness)")
    a = ap.parse_args()
    a.durations = [float(x) for x in a.durations.split(",")]
    a.part1_deadline = time.monotonic() + a.part1_s
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    sock = str(Path(tempfile.mkdtemp(prefix="sl-win-")) / "s.sock")
    d = subprocess.Popen([sys.executable, "-m", "stacklens.daemon.server", "--socket", sock, "--metrics-address", "off"],
                         stdout=subprocess.PIPE, stderr=open(out / "stacklensd.log", "w"), text=True)
    assert "ready" in d.stdout.readline()
    log("stacklensd ready")
    result: dict = {"rows": [], "decode": None}
    try:
        if "part1" not in a.skip:
            try:
                part1(sock, a, out, result["rows"])
            except Exception:  # noqa: BLE001
                result["part1_error"] = traceback.format_exc()[-1500:]
        (out / "daemon_windows.json").write_text(json.dumps(result, indent=1))
        if "part2" not in a.skip:
            try:
                result["decode"] = part2(sock, a, out)
            except Exception:  # noqa: BLE001
                result["part2_error"] = traceback.format_exc()[-1500:]
    finally:
        d.terminate()
        try:
            d.wait(30)
        except subprocess.TimeoutExpired:
            d.kill()
        (out / "daemon_windows.json").write_text(json.dumps(result, indent=1))
        md = table(result["rows"])
        dec = result.get("decode") or {}
        md += ["", f"decode held session: {json.dumps(dec.get('held'))}",
               f"vs torch.profiler: {json.dumps({k: v for k, v in (dec.get('compare') or {}).items() if k != 'rows'})}"]
        (out / "daemon_windows.md").write_text("\n".join(md) + "\n")
        print("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
