"""Records the rings tests/replay decodes: a real ProbeSession attached to a target of
tests/targets, the raw ring records its RingDecoder was given, and every fact the decoder read
from outside them (the target's memory as pysym read it, native frames by address, the BPF
stack, op-path and Python-stack maps, op names, autograd vtable names), so that replay needs
neither root nor a live process.

Requires root + BCC (a BPF compile, ~5-10 s each) and a C compiler (the fake libcuda).

    .venv/bin/python tests/data/rings/record.py                  # every scenario
    .venv/bin/python tests/data/rings/record.py named_loop       # one

Targets run under a launcher that compiles their source with the path relative to the
repository (`tests/targets/…`), so the code objects read from memory name no machine path; the
recording is refused if one (the repository root, /tmp) is found in it anyway.
"""

from __future__ import annotations

import base64
import dataclasses
import gzip
import json
import os
import select
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
OUT = Path(__file__).resolve().parent
# runs `python -c LAUNCH TARGET ARGS…` from the repository root: the target's code objects (and
# those of the modules it imports from tests/targets, preloaded the same way) name relative paths
LAUNCH = """
import sys, types
for name in ("fake_slept",):
    p = f"tests/targets/{name}.py"
    m = types.ModuleType(name)
    m.__file__ = p
    exec(compile(open(p).read(), p, "exec"), m.__dict__)
    sys.modules[name] = m
p = sys.argv[1]
sys.argv = sys.argv[1:]
exec(compile(open(p).read(), p, "exec"), {"__name__": "__main__"})
"""
MACHINE_PATHS = (str(ROOT).encode(), b"/tmp/", tempfile.gettempdir().encode() + b"/")


def b64(b: bytes | None) -> str | None:
    return None if b is None else base64.b64encode(b).decode()


class Recording:
    """What the decoder read, by what it asked."""

    def __init__(self) -> None:
        self.records: list[bytes] = []
        self.mem: dict[tuple[int, int], bytes | None] = {}
        self.frames: dict[int, tuple] = {}
        self.exact: dict[int, str] = {}
        self.stacks: dict[tuple[str, int], list[int] | None] = {}
        self.op_paths: dict[int, list[int] | None] = {}
        self.py_stacks: dict[int, bytes | None] = {}
        self.vtables: dict[int, str | None] = {}


class RecMem:
    def __init__(self, inner, rec: Recording) -> None:
        self.inner, self.rec = inner, rec

    def read(self, addr: int, n: int) -> bytes:
        try:
            b = self.inner.read(addr, n)
        except Exception:
            self.rec.mem[(addr, n)] = None
            raise
        self.rec.mem[(addr, n)] = b
        return b


class RecNative:
    def __init__(self, inner, rec: Recording) -> None:
        self.inner, self.rec = inner, rec

    def frame(self, addr: int):
        f = self.rec.frames[addr] = self.inner.frame(addr)
        return f

    def exact_name(self, addr: int) -> str:
        s = self.rec.exact[addr] = self.inner.exact_name(addr)
        return s


class RecMaps:
    def __init__(self, inner, rec: Recording) -> None:
        self.inner, self.rec = inner, rec

    def walk_stack(self, table: bytes, key: int):
        try:
            addrs = list(self.inner.walk_stack(table, key))
        except Exception:
            self.rec.stacks[(table.decode(), key)] = None
            raise
        self.rec.stacks[(table.decode(), key)] = addrs
        return addrs

    def op_path(self, h: int):
        try:
            p = self.inner.op_path(h)
        except KeyError:
            self.rec.op_paths[h] = None
            raise
        self.rec.op_paths[h] = list(p)
        return p

    def py_stack(self, pyid: int) -> bytes:
        try:
            b = self.inner.py_stack(pyid)
        except KeyError:
            self.rec.py_stacks[pyid] = None
            raise
        self.rec.py_stacks[pyid] = b
        return b


class RecVtables:
    def __init__(self, inner, rec: Recording) -> None:
        self.inner, self.rec = inner, rec

    def name(self, vptr: int):
        n = self.rec.vtables[vptr] = self.inner.name(vptr)
        return n


def record_decode(decoder, rec: Recording):
    """Wraps decoder.decode: the records it consumes are copied first (the producers may reuse
    their space once it commits)."""
    from stacklens.bpf.decode import RecordList
    from stacklens.bpf.ringbuf import BUSY, DISCARD

    decode = decoder.decode

    def recording(reader, max_events):
        data, mask = reader.data, reader.mask
        cons, prod = reader.positions()
        seen = []
        pos = cons
        while pos < prod:
            ln = int.from_bytes(data[pos & mask:(pos & mask) + 4], "little")
            if ln & BUSY:
                break
            n = ln & 0x3FFFFFFF
            if not ln & DISCARD:
                seen.append((pos, bytes(data[(pos & mask) + 8:(pos & mask) + 8 + n])))
            pos += (n + 15) & ~7
        out = decode(reader, max_events)
        end = prod if isinstance(reader, RecordList) else reader.positions()[0]
        rec.records += [r for p, r in seen if p < end and int.from_bytes(r[8:12], "little") == decoder.pid]
        return out

    decoder.decode = recording


def frame_json(f) -> list:
    return [f.kind, f.name, f.file, f.line]


def event_json(e) -> list:
    return [e.kind, e.api, e.kernel_name, e.bytes, e.direction, list(e.op_path),
            [frame_json(f) for f in e.py_stack], [frame_json(f) for f in e.native_stack], list(e.py_entries)]


def start(argv: list[str], env: dict | None = None) -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, "-c", LAUNCH, *argv], cwd=ROOT, stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True, env={**os.environ, **(env or {})})
    r, _, _ = select.select([p.stdout], [], [], 60)
    if not r or p.stdout.readline().strip() != "ready":
        p.kill()
        raise SystemExit(f"{argv[0]} did not print ready")
    return p


def build_fake_libs(d: Path) -> None:
    cc = shutil.which("cc") or shutil.which("gcc")
    flags = ["-O1", "-g", "-fno-omit-frame-pointer", "-mno-omit-leaf-frame-pointer", "-fPIC", "-shared"]
    fakes = ROOT / "tests" / "fakes"
    subprocess.run([cc, *flags, "-o", str(d / "libcuda.so.1"), str(fakes / "fake_cuda.c")], check=True)
    subprocess.run([cc, *flags, "-o", str(d / "libfakeapp.so"), str(fakes / "fake_app.c"), f"-L{d}",
                    "-l:libcuda.so.1", f"-Wl,-rpath,{d}"], check=True)


def scenario_named_loop(rec: Recording):
    """CPU samples of a pure-Python loop: Python frames through exec'd code, native frames."""
    from stacklens.bpf import ProbeConfig

    p = start(["tests/targets/named_loop.py", "replay_hot_loop"])
    return p, ProbeConfig(gpu=False, ops=False, rescan_interval_s=0), lambda s: poll_for(s, 4)


def scenario_fake_cuda(rec: Recording):
    """The fake libcuda's launches (named kernels, stacks from the stack maps), an alloc, copies
    of each direction, a free and a sync, from known Python functions."""
    from stacklens.bpf import ProbeConfig

    d = Path(tempfile.mkdtemp(prefix="sl-rings-"))
    build_fake_libs(d)
    p = start(["tests/targets/fake_cuda_app.py", str(d), "7", "5"], env={"FAKE_SYNC_US": "2000"})

    def run(s):
        p.stdin.write("\n")
        p.stdin.flush()
        p.stdout.readline()                     # done …
        evs = []
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not any(e.kind == "sync" for e in evs):
            evs += s.poll(100)
        return evs + poll_for(s, 0.3)

    return p, ProbeConfig(ops=False, cpu_sample_hz=0, rescan_interval_s=0), run


def poll_for(s, seconds: float) -> list:
    evs = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        evs += s.poll(100)
    return evs


SCENARIOS = {"named_loop": scenario_named_loop, "fake_cuda": scenario_fake_cuda}


def record(name: str) -> Path:
    from stacklens.bpf import ProbeSession

    rec = Recording()
    proc, config, run = SCENARIOS[name](rec)
    try:
        s = ProbeSession(proc.pid, config)
        s.attach()
        d = s._decoder
        d.maps, d.native, d._vtables = RecMaps(d.maps, rec), RecNative(d.native, rec), RecVtables(d._vtables, rec)
        if d.py is not None:
            d.py.mem = RecMem(d.py.mem, rec)
        record_decode(d, rec)
        try:
            events = run(s)
        finally:
            s.detach()
    finally:
        proc.kill()
        proc.wait()
    return save(name, proc.pid, d, rec, events)


def save(name: str, pid: int, d, rec: Recording, events) -> Path:
    py = d.py
    doc = {
        "scenario": name, "recorded_by": "tests/data/rings/record.py", "pid": pid,
        "layout": None if py is None else dataclasses.asdict(py.layout),
        "code_type_addr": 0 if py is None else py.code_type_addr, "py_max_depth": d.py_max_depth,
        "specs": [[s.index, s.symbol] for s in d._specs], "op_names": list(d._op_names),
        "records": [b64(r) for r in rec.records],
        "mem": [[a, n, b64(b)] for (a, n), b in rec.mem.items()],
        "frames": [[a, frame_json(f)] for a, f in rec.frames.items()],
        "exact": [[a, s] for a, s in rec.exact.items()],
        "stacks": [[t, k, v] for (t, k), v in rec.stacks.items()],
        "op_paths": [[h, v] for h, v in rec.op_paths.items()],
        "py_stacks": [[i, b64(b)] for i, b in rec.py_stacks.items()],
        "vtables": [[v, n] for v, n in rec.vtables.items()],
        "live": {"events": [event_json(e) for e in events], "counts": d.counts},
    }
    raw = json.dumps(doc, separators=(",", ":")).encode()
    blobs = raw + b"".join(b for b in rec.mem.values() if b) + b"".join(rec.records)
    for bad in MACHINE_PATHS:
        if bad in blobs:
            raise SystemExit(f"{name}: the recording names {bad.decode()}: not saved")
    out = OUT / f"{name}.json.gz"
    out.write_bytes(gzip.compress(raw, 9, mtime=0))
    print(f"{out.relative_to(ROOT)}: {len(rec.records)} records, {len(events)} events, "
          f"{len(rec.mem)} memory reads, {out.stat().st_size / 1024:.0f} KiB")
    return out


if __name__ == "__main__":
    for n in sys.argv[1:] or list(SCENARIOS):
        record(n)
