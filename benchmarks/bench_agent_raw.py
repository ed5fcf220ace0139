"""The agent's own cost per raw CUPTI buffer, on the target's side (issue 9), without a GPU.

A fake libcupti (tests/fakes/fake_cupti.c, built here with cc) hands 1 MiB buffers of 216-byte
records back from a native thread, as CUPTI does; the agent's real path takes them:
- copy: ctypes trampoline → copy out → collector (`_raw_buffer`, sizes mode) → byte-bounded queue
  → raw frame → outbox → a socketpair drained by a reader thread;
- ref (the default since session 4): trampoline → collector (`_raw_ref`) → the buffer stays in
  place, a small `cupti_ref` message goes out; the reader plays the daemon's `free`.
Reported: wall µs per buffer and per record for the collector + send path (what holds the
target's GIL) and the agent thread's wake-ups, measured over N buffers.

    .venv/bin/python benchmarks/bench_agent_raw.py [--buffers 200] [--mode copy|ref]
"""

from __future__ import annotations

import argparse
import ctypes
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

from stacklens.inject.agent import Agent  # noqa: E402
from stacklens.inject.agent.gpu import cupti as cupti_mod  # noqa: E402
from stacklens.inject.agent.gpu import cupti_raw  # noqa: E402

RECORD = 216
BUFFER = 1 << 20


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--buffers", type=int, default=200)
    ap.add_argument("--mode", choices=("copy", "ref"), default="ref")
    a = ap.parse_args()
    cc = shutil.which("cc") or shutil.which("gcc")
    d = Path(tempfile.mkdtemp())
    lib = d / "libcupti.so.13"
    subprocess.run([cc, "-O2", "-fPIC", "-shared", "-pthread", "-o", str(lib), str(REPO / "tests/fakes/fake_cupti.c")],
                   check=True)
    n = BUFFER // RECORD
    data = b"".join(struct.pack("<I", 10) + b"\x11" * (RECORD - 4) for _ in range(n))
    fake = ctypes.CDLL(str(lib))
    a_sock, b_sock = socket.socketpair()
    agent = Agent(a_sock, "tok")

    def reader():                               # the daemon's end: drain the socket
        while b_sock.recv(1 << 20):
            pass

    threading.Thread(target=reader, daemon=True).start()
    col = cupti_mod.CuptiCollector(lambda *x: None)
    col.sink = agent.gpu.sink
    col.clock = type("C", (), {"offset_ns": 0})()
    col._raw_sizes = {10: RECORD}               # what _layout() learns from cupti-python's dtypes
    col._verified = cupti_raw.VERIFY_BUFFERS    # the size walk verified: no walk per buffer
    cb = cupti_raw._ctypes_callbacks(str(lib), col._raw_buffer, col.wants_offsets)
    col._raw_cb = cb
    agent.gpu.collector = col
    if a.mode == "ref":
        cb.on_ref, cb.max_shipped, cb.shipped = col._raw_ref, col.max_shipped, col._shipped
    t_cb = t_send = 0.0
    pumps = 0
    for _ in range(a.buffers):
        fake.fake_cupti_stage(data, ctypes.c_size_t(len(data)), ctypes.c_uint32(10), ctypes.c_size_t(RECORD))
        t0 = time.perf_counter()
        cb.flush_all(0)                         # request + copy + completion from a native thread
        t1 = time.perf_counter()
        agent.gpu.send()               # frame the buffer (or its address) into the outbox
        while agent.ch.out:
            agent.ch.pump(0.01)                 # what the socket takes
            pumps += 1
        t2 = time.perf_counter()
        if a.mode == "ref":                     # the daemon has read it: free (not timed)
            agent.gpu.release(list(cb.shipped))
        t_cb += t1 - t0
        t_send += t2 - t1
    a_sock.close()
    per_buf = (t_cb + t_send) / a.buffers * 1e6
    print(f"{a.buffers} buffers of {len(data)} bytes ({n} records): callback+copy+collector "
          f"{t_cb / a.buffers * 1e6:.0f} us, frame+send {t_send / a.buffers * 1e6:.0f} us per buffer; "
          f"{per_buf / n * 1000:.0f} ns per record; at 140k records/s: {per_buf / n * 140_000 / 1e4:.2f}% of a core "
          f"(mode {a.mode}; socket writes needing a wake-up: {pumps / a.buffers:.1f} per buffer; "
          f"buffers dropped: {agent.gpu.raw_dropped}; valid bytes per buffer {len(data)})")


if __name__ == "__main__":
    main()
