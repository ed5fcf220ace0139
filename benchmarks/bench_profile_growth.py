"""Profile growth on a steady workload: does the CCT stop growing once every context was seen?

    .venv/bin/python benchmarks/bench_profile_growth.py [--target stripped|torch] [--duration 180]
        [--interval 15] [--hz 99] [--agent] [--no-frame-pointers]

Why: on the H200 a steady ViT loop (probes + agent, 8.4 min) grew from 5.8k to 34.8k CCT nodes
(40 → 196 KB gzip), bounded only by max_nodes. A steady loop has a fixed set of Python lines,
operators and kernels, so every context is seen within seconds; what keeps coming are frames
that name an address. libcuda.so exports only its cu* API, so most of its frames had no symbol.

Targets (real probes through `stacklens.daemon.session.ProcessSession`, root needed):
- `stripped` (default): Python calls, through ctypes, `steady_step` of a C library built here
  with `gcc -s` and named libcuda.so.1 so the launch probes attach. It exports only cuInit,
  cuLaunchKernel and steady_step; steady_step runs WORKERS internal static functions (integer
  loops, so CPU samples land on many instructions), a third of them through one more internal
  function, each ending in cuLaunchKernel with one of 8 handles. With frame pointers by default;
  `--no-frame-pointers` builds it -O2 without them, as vendors ship libcuda.
- `torch`: the bundled demo (`stacklens.cli.demo_workload`, an MLP on the CPU) with real
  libtorch; `--agent` injects the agent too (py_samples from the in-process sampler).

Every `--interval` seconds it prints the cumulative snapshot's node count and gzip profile size
(`cct.export.encode_profile`, what stacklensd sends), the same for the last 60 s window, how many
distinct frames in the cumulative tree name an address ("0x…" in the name, kernels excluded),
the events joined so far, and this process's RSS (it holds the session, as stacklensd would).
`--hz` sets the CPU sampling rate (99 Hz as the daemon default; a higher rate reaches the same
number of samples sooner).
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from stacklens.cct.export import encode_profile
from stacklens.daemon.session import ProcessSession

WORKERS = 48
HANDLES = 8
UNROLL = 8
WINDOW_S = 60.0

_TARGET = """
import ctypes, sys
lib = ctypes.CDLL(sys.argv[1])
lib.steady_step.restype = ctypes.c_uint64
lib.steady_step.argtypes = [ctypes.c_uint64, ctypes.c_int]

def forward(x):
    return lib.steady_step(x, 4000)

def main():
    x = 1
    print("ready", flush=True)
    while True:
        x = forward(x)

main()
"""


def c_source() -> str:
    """The stripped library: cuInit, cuLaunchKernel, steady_step exported; the rest static."""
    out = [
        "#include <stdint.h>",
        "#define EXPORT __attribute__((visibility(\"default\"), noinline))",
        "#define INTERNAL static __attribute__((noinline))",
        "static volatile uint64_t sink;",
        "EXPORT int cuInit(unsigned flags) { sink += flags; return 0; }",
        "EXPORT int cuLaunchKernel(void *f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,",
        "                          unsigned bz, unsigned shm, void *stream, void **params, void **extra)",
        "{ sink += (uintptr_t)f + gx + gy + gz + bx + by + bz + shm + (uintptr_t)stream"
        " + (uintptr_t)params + (uintptr_t)extra; return 0; }",
        "INTERNAL uint64_t mix(uint64_t x, int reps) {",
        "    for (int r = 0; r < reps; r++) { x ^= x >> 7; x *= 0xff51afd7ed558ccdULL; x += (uint64_t)r; }",
        "    cuLaunchKernel((void *)0x9000, 1, 1, 1, 32, 1, 1, 0, 0, 0, 0);",
        "    return x;",
        "}",
    ]
    for i in range(WORKERS):
        # UNROLL different steps per loop: a few thousand distinct instructions in all
        body = " ".join(
            f"x = x * {6364136223846793005 + 2 * (i * UNROLL + u)}ULL + {u + 1}; x ^= x >> {(i + u) % 13 + 1}; "
            f"x += (x << {(7 * i + u) % 31 + 1}) ^ {(i * UNROLL + u) * 2654435761}ULL;"
            for u in range(UNROLL))
        out += [
            f"INTERNAL uint64_t work_{i}(uint64_t x, int reps) {{",
            f"    for (int r = 0; r < reps; r++) {{ {body} }}",
            "    x = mix(x, reps / 4);" if i % 3 == 0 else "",
            f"    cuLaunchKernel((void *)(uintptr_t){0x1000 + (i % HANDLES) * 0x10}, {1 + i % 4}, 1, 1, 128, 1, 1,"
            " 0, 0, 0, 0);",
            "    return x;",
            "}",
        ]
    out += ["EXPORT uint64_t steady_step(uint64_t x, int reps) {"]
    out += [f"    x = work_{i}(x, reps);" for i in range(WORKERS)]
    out += ["    return x;", "}"]
    return "\n".join(out) + "\n"


def build_stripped(d: Path, frame_pointers: bool) -> Path:
    cc = shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        raise SystemExit("needs gcc (or cc) to build the stripped library")
    src = d / "steady.c"
    src.write_text(c_source())
    lib = d / "libcuda.so.1"
    fp = ["-O1", "-fno-omit-frame-pointer", "-mno-omit-leaf-frame-pointer"] if frame_pointers \
        else ["-O2", "-fomit-frame-pointer"]
    subprocess.run([cc, *fp, "-fPIC", "-shared", "-s", "-o", str(lib), str(src)], check=True)
    return lib


def start_target(args, d: Path) -> subprocess.Popen:
    if args.target == "stripped":
        lib = build_stripped(d, not args.no_frame_pointers)
        script = d / "steady_target.py"
        script.write_text(_TARGET)
        cmd = [sys.executable, str(script), str(lib)]
    else:
        cmd = [sys.executable, "-m", "stacklens.cli.demo_workload"]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    line = p.stdout.readline()
    if not line.startswith("ready"):
        p.kill()
        raise SystemExit(f"target did not start: {line!r}")
    return p


def rss_mib() -> float:
    """This process's resident memory: it holds the session, as stacklensd would."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def address_frames(snap) -> int:
    """Distinct frames that name an address (kernel frames, "unresolved:0x<handle>", excluded)."""
    return len({f for f in snap._frames if f.kind != "kernel" and "0x" in f.name})


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", choices=("stripped", "torch"), default="stripped")
    ap.add_argument("--duration", type=float, default=180.0)
    ap.add_argument("--interval", type=float, default=15.0)
    ap.add_argument("--hz", type=int, default=99, help="CPU sampling rate of the BPF perf event")
    ap.add_argument("--agent", action="store_true", help="inject the agent as well")
    ap.add_argument("--no-frame-pointers", action="store_true", help="stripped target: -O2 without frame pointers")
    args = ap.parse_args()

    d = Path(tempfile.mkdtemp(prefix="stacklens-growth-"))
    target = start_target(args, d)
    session = ProcessSession(target.pid, agent=args.agent, cpu_hz=args.hz)
    rows = []
    try:
        session.start()
        t0 = time.monotonic()
        print(f"# {args.target} pid={target.pid} hz={args.hz} agent={args.agent} "
              f"frame_pointers={not args.no_frame_pointers}")
        print("#    t  nodes  gz_KB  win_nodes  win_gz_KB  addr_frames  cpu_samples  launches  folded  rss_MiB")
        while True:
            time.sleep(max(0.0, t0 + (len(rows) + 1) * args.interval - time.monotonic()))
            t = time.monotonic() - t0
            snap = session.snapshot()
            win = session.snapshot(window_s=min(WINDOW_S, t))
            st = session.stats()
            row = (t, snap.node_count, len(encode_profile(snap)) / 1024, win.node_count,
                   len(encode_profile(win)) / 1024, address_frames(snap), st.get("cpu_samples", 0),
                   st.get("launches", 0), snap.folded_nodes, rss_mib())
            rows.append(row)
            print("%6.0f %6d %6.1f %10d %10.1f %12d %12d %9d %7d %8.1f" % row, flush=True)
            if t >= args.duration or session.state != "attached":
                break
    finally:
        session.stop()
        target.kill()
        target.wait()
        shutil.rmtree(d, ignore_errors=True)
    print(f"# machine: {platform.node()}, {os.cpu_count()} CPUs, kernel {platform.release()}, "
          f"Python {platform.python_version()}")
    if len(rows) >= 3:
        mid, last = rows[len(rows) // 2], rows[-1]
        print(f"# second half: nodes {mid[1]} -> {last[1]} ({last[1] - mid[1]:+d}), "
              f"gz {mid[2]:.1f} -> {last[2]:.1f} KB, rss {mid[9]:.1f} -> {last[9]:.1f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
