"""Which libcuda exports each GPU API probe attaches to on this machine, and whether one call is
one event (issue 23: libcuda 580 exports cuCtxSynchronize_v2, which torch.cuda.synchronize()
reaches).

    python benchmarks/gpu/probe_exports.py [--lib PATH] [--calls N] [--json OUT]

Static part (no root): resolves bpf/probes.toml against the library's exports (bpf/spec.py),
prints probe -> exports, exports sharing code, and for probes with several exports whether one
export's code calls another's (objdump -d, where installed: a wrapper would count an entry-only
launch twice). Runtime part (root, GPU, torch): attaches a ProbeSession to a child that runs N
`torch.cuda.synchronize()` after a kernel, then N `cuCtxSynchronize()` through ctypes (the
legacy entry), and counts sync events per phase: each must be N, and the time inside them
close to what the child timed.
"""

from __future__ import annotations

import argparse
import ctypes.util
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from stacklens.bpf.spec import load_specs, resolve_library

CHILD = textwrap.dedent("""
    import ctypes, sys, time, torch
    n = int(sys.argv[1])
    x = torch.randn(2048, 2048, device="cuda"); torch.cuda.synchronize()
    cuda = ctypes.CDLL("libcuda.so.1")
    print("ready", flush=True); sys.stdin.readline()
    out = {}
    for phase in ("torch", "legacy"):
        t = 0.0
        for _ in range(n):
            y = x @ x
            t0 = time.perf_counter()
            torch.cuda.synchronize() if phase == "torch" else cuda.cuCtxSynchronize()
            t += time.perf_counter() - t0
        out[phase] = t
        print(f"{phase} {time.monotonic_ns()} {t}", flush=True)
        sys.stdin.readline()
    print("done", flush=True); sys.stdin.readline()
""")


def find_libcuda(path: str | None) -> str:
    if path:
        return path
    name = ctypes.util.find_library("cuda") or "libcuda.so.1"
    ctypes.CDLL(name)
    for line in Path("/proc/self/maps").read_text().splitlines():
        if re.search(r"/libcuda\.so", line):
            return line.split()[-1]
    raise SystemExit("no libcuda found; pass --lib")


def calls_between(lib: str, exports: list[str]) -> list[tuple[str, str]]:
    """(caller, callee) pairs among `exports` from objdump's disassembly of each one."""
    if shutil.which("objdump") is None or len(exports) < 2:
        return []
    out = []
    for e in exports:
        txt = subprocess.run(["objdump", "-d", "--no-show-raw-insn", f"--disassemble={e}", lib],
                             capture_output=True, text=True).stdout
        for other in exports:
            if other != e and re.search(rf"\b(call|jmp)\w*\s+\S+\s+<{re.escape(other)}(@plt)?>", txt):
                out.append((e, other))
    return out


def runtime_check(calls: int) -> dict:
    from stacklens.bpf import ProbeConfig, ProbeSession

    p = subprocess.Popen([sys.executable, "-c", CHILD, str(calls)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "ready"
    s = ProbeSession(p.pid, ProbeConfig(cpu_sample_hz=0, ops=False))
    report = s.attach()
    evs: list = []
    res: dict = {"notes": list(report.notes)}
    try:
        p.stdin.write("go\n"); p.stdin.flush()
        for _ in ("torch", "legacy"):
            phase, _, wall = p.stdout.readline().split()
            time.sleep(0.3)
            got = []
            for _ in range(10):
                got += s.poll(timeout_ms=100)
            sync = [e for e in got if e.kind == "sync"]
            res[phase] = {"calls": calls, "sync_events": len(sync), "apis": sorted({e.api for e in sync}),
                          "sync_wait_s": sum(e.duration_ns for e in sync) / 1e9, "timed_in_target_s": float(wall)}
            evs += got
            p.stdin.write("next\n"); p.stdin.flush()
        res["stats"] = {k: v for k, v in s.stats().items() if k in ("pending_miss", "drops")}
    finally:
        s.detach()
        p.kill()
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lib")
    ap.add_argument("--calls", type=int, default=50)
    ap.add_argument("--static-only", action="store_true")
    ap.add_argument("--json")
    a = ap.parse_args()
    lib = find_libcuda(a.lib)
    specs = [s for s in load_specs() if "libcuda" in s.library]
    res = resolve_library(os.path.realpath(lib), specs)
    by: dict[str, list[str]] = {}
    for site in res.sites:
        by.setdefault(site.spec.symbol, []).append(site.export)
    out = {"lib": os.path.realpath(lib), "probes": by, "missing": list(res.missing), "aliases": res.aliases,
           "calls_between": {p: calls_between(lib, e) for p, e in by.items() if len(e) > 1}}
    print(f"{out['lib']}: {len(res.sites)} sites for {len(by)} of {len(specs)} probes")
    for p, e in by.items():
        calls = out["calls_between"].get(p)
        print(f"  {p:28} -> {', '.join(e)}" + (f"   CALLS {calls}" if calls else ""))
    print(f"  missing: {', '.join(res.missing) or '-'}; aliases: {res.aliases or '-'}")
    if not a.static_only:
        out["runtime"] = runtime_check(a.calls)
        for phase in ("torch", "legacy"):
            r = out["runtime"][phase]
            ok = r["sync_events"] == r["calls"]
            print(f"  {phase:6}: {r['sync_events']} sync events for {r['calls']} calls ({'ok' if ok else 'MISMATCH'}), "
                  f"{r['sync_wait_s']:.4f} s measured vs {r['timed_in_target_s']:.4f} s timed, apis {r['apis']}")
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1, default=list))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
