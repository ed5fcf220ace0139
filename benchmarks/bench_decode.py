"""Decoding a 100,000-node snapshot from stacklensd's wire format, old vs new, side by side.

No privilege. What `stacklens top` does once a second in its fetch worker (under the GIL):

- `json (REF reader)`: gzip stacklens JSON → `from_json` as of git revision REF (`--baseline-ref`,
  default the commit before the columnar form), loaded from `git show`;
- `json`: the same bytes → today's `from_json` (column-wise checks);
- `columnar`: `encode_profile`'s gzip columnar form → `decode_profile`, what stacklensd sends.

Rounds interleave the readers so that a loaded machine slows them alike; the garbage collector
is off while decoding, as in the TUI's fetch worker.

`--rings N`: also the BPF ring decoder's CPU per event (bpf/decode.py RingDecoder, what
ProbeSession.poll does under the GIL), over each recorded ring of tests/data/rings repeated N
times (the decoder's caches warm after the first copy, as in a long session).

    .venv/bin/python benchmarks/bench_decode.py --nodes 100000 --rounds 7 [--rings 2000]
"""

from __future__ import annotations

import argparse
import gc
import gzip
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from stacklens.cct import export
from stacklens.tui.testing import synthetic_snapshot

ROOT = Path(__file__).resolve().parents[1]


def old_export(ref: str):
    """cct/export.py at `ref`, imported as a standalone module (relative imports made absolute)."""
    src = subprocess.run(["git", "-C", str(ROOT), "show", f"{ref}:cct/export.py"], check=True, capture_output=True, text=True).stdout
    src = (
        src.replace("from .. import __version__", "from stacklens import __version__")
        .replace("from ..errors", "from stacklens.errors")
        .replace("from .frames", "from stacklens.cct.frames")
        .replace("from .snapshot", "from stacklens.cct.snapshot")
    )
    path = Path(tempfile.mkdtemp()) / "old_export.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location("old_export", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def ring_decode(copies: int, rounds: int) -> None:
    """CPU ns per event of RingDecoder.decode over the recorded rings (no root: tests/replay)."""
    sys.path.insert(0, str(ROOT))   # tests.replay
    from stacklens.bpf.decode import RecordList
    from tests.replay.rings import load

    print(f"# ring decode: each recorded ring x{copies}, {rounds} rounds (CPU ns per event)")
    print("| ring | events a round | median ns/event | min ns/event |")
    print("|---|---|---|---|")
    for name in ("named_loop", "fake_cuda"):
        ring = load(name)
        records = RecordList(ring.records * copies)
        per = []
        gc.disable()
        for _ in range(rounds):
            c0 = time.thread_time()
            n = len(ring.decoder.decode(records, 1 << 30))
            per.append((time.thread_time() - c0) / n * 1e9)
        gc.enable()
        print(f"| {name} | {n:,} | {statistics.median(per):.0f} | {min(per):.0f} |")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nodes", type=int, default=100_000)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--baseline-ref", default="573f0fe", help="git revision whose from_json is the 'old' reader")
    p.add_argument("--rings", type=int, default=0, help="also time the BPF ring decoder (copies of each ring)")
    args = p.parse_args()

    snap = synthetic_snapshot(args.nodes)
    t0 = time.perf_counter()
    json_blob = gzip.compress(json.dumps(export.to_json(snap), separators=(",", ":")).encode(), compresslevel=1)
    t_json_enc = time.perf_counter() - t0
    t0 = time.perf_counter()
    col_blob = export.encode_profile(snap)
    t_col_enc = time.perf_counter() - t0
    assert export.decode_profile(col_blob) == snap and export.decode_profile(json_blob) == snap

    readers = {}
    try:
        old = old_export(args.baseline_ref)
        readers[f"json ({args.baseline_ref} reader)"] = lambda: old.from_json(json.loads(gzip.decompress(json_blob)))
    except (subprocess.CalledProcessError, FileNotFoundError) as e:
        print(f"(no baseline reader: {e})")
    readers["json"] = lambda: export.decode_profile(json_blob)
    readers["columnar"] = lambda: export.decode_profile(col_blob)

    times: dict[str, list[float]] = {name: [] for name in readers}
    cpu: dict[str, list[float]] = {name: [] for name in readers}
    gc.disable()
    for _ in range(args.rounds):
        for name, read in readers.items():
            c0, t0 = time.thread_time(), time.perf_counter()
            result = read()
            times[name].append(time.perf_counter() - t0)
            cpu[name].append(time.thread_time() - c0)
            del result
    gc.enable()

    print(f"# decode of a {snap.node_count:,}-node snapshot, {args.rounds} interleaved rounds")
    print(f"machine: {platform.machine()} {os.cpu_count()} CPUs, Python {platform.python_version()}, {platform.platform()}; load average {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    print(f"wire size: json.gz {len(json_blob) / 1e6:.2f} MB (encode {1000 * t_json_enc:.0f} ms), columnar.gz {len(col_blob) / 1e6:.2f} MB (encode {1000 * t_col_enc:.0f} ms)")
    print("| reader | wall median ms | wall min ms | CPU median ms |")
    print("|---|---|---|---|")
    for name in readers:
        print(f"| {name} | {1000 * statistics.median(times[name]):.0f} | {1000 * min(times[name]):.0f} | {1000 * statistics.median(cpu[name]):.0f} |")
    if args.rings:
        ring_decode(args.rings, args.rounds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
