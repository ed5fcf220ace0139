"""What a uprobe hit costs by the instruction it sits on, and what the probed functions start with.

x86-64 uprobes emulate a few instructions (push, nop, jmp/call/jcc; a 5-byte nop is optimized
to a trampoline on 6.18); any other one is copied out of line and single-stepped, a second trap.
In a Firecracker VM the single step is the expensive part. This bench times calls to functions
that start with each kind of instruction, unprobed and with an empty BPF uprobe, and lists the
first instruction bytes of the functions stacklens probes (libcuda launch/copy/sync symbols
from bpf/probes.toml, libtorch `at::_ops::*::call`).

    python benchmarks/bench_uprobe_sites.py [--calls N] [--lib PATH/libcuda.so.1 ...] [--torch]

Needs root and BCC for the timing part, a C compiler (or --prebuilt PATH) for the test library.
The test library is built with -fcf-protection=none (else GCC may put endbr64 in front of the
naked functions) and each site's first instruction is checked against its name before timing.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO.parent) not in sys.path:
    sys.path.insert(0, str(REPO.parent))

# name -> instructions at the entry (AT&T), then the body returns x + 1
KINDS = {
    "push_rbp": "push %rbp; pop %rbp",
    "push_r15": "push %r15; pop %r15",
    "nop": "nop",
    "nop5": ".byte 0x0f,0x1f,0x44,0x00,0x00",
    "endbr64_push": "endbr64; push %rbp; pop %rbp",
    "sub_rsp": "sub $8,%rsp; add $8,%rsp",
    "mov_reg": "mov %rdi,%rax",
    "mov_rsp": "mov %rsp,%rax",
    "xor": "xor %eax,%eax",
}


def c_source() -> str:
    out = []
    for k, body in KINDS.items():
        out.append(f'__attribute__((noinline,naked)) int site_{k}(int x) '
                   f'{{ __asm__ volatile("{body}; lea 1(%rdi),%eax; ret"); }}')
    return "\n".join(out) + "\n"


# what first_op must say for each site (a site that starts otherwise would time another
# instruction); for the "other" kinds, the start of their bytes
EXPECTED_OP = {"push_rbp": "push", "push_r15": "push", "nop": "nop", "nop5": "nop5",
               "endbr64_push": "endbr64 + push", "sub_rsp": "other:4883ec08", "mov_reg": "other:4889f8",
               "mov_rsp": "other:4889e0", "xor": "other:31c0"}


def build(prebuilt: str | None, workdir: str) -> str:
    if prebuilt:
        return prebuilt
    src, lib = Path(workdir, "sites.c"), Path(workdir, "libsites.so")
    src.write_text(c_source())
    subprocess.run(["cc", "-O2", "-shared", "-fPIC", "-fcf-protection=none", "-o", str(lib), str(src)],
                   check=True)
    return str(lib)


def check_sites(lib: str) -> None:
    """Each site_<kind> must start with the instruction its name says; SystemExit if one does not."""
    got = entry_bytes(lib, [f"site_{k}" for k in KINDS])
    bad = []
    for k in KINDS:
        h = got.get(f"site_{k}")
        op = first_op(h) if h is not None else "missing"
        want = EXPECTED_OP[k]
        if not (op.startswith(want) if want.startswith("other:") else op == want):
            bad.append(f"site_{k}: starts with {op} ({h}), expected {want}")
    if bad:
        sys.exit(f"{lib}: sites do not start with their instruction:\n  " + "\n  ".join(bad))


def time_calls(lib: str, sym: str, n: int) -> float:
    """µs per call, in a child process (so the probe is on a process BPF does not own)."""
    code = (f"import ctypes,time\nf=getattr(ctypes.CDLL({lib!r}),{sym!r})\nf.argtypes=[ctypes.c_int]\n"
            f"t=time.perf_counter()\nfor i in range({n}): f(i)\nprint((time.perf_counter()-t)/{n}*1e6)")
    return float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                check=True).stdout)


def timing(lib: str, n: int) -> dict:
    from bcc import BPF

    b = BPF(text="int hit(struct pt_regs *ctx) { return 0; }")
    res = {}
    for k in KINDS:
        sym = f"site_{k}"
        base = min(time_calls(lib, sym, n) for _ in range(2))
        b.attach_uprobe(name=lib, sym=sym, fn_name="hit")
        try:
            probed = min(time_calls(lib, sym, n) for _ in range(2))
        finally:
            b.detach_uprobe(name=lib, sym=sym)
        res[k] = {"unprobed_us": round(base, 3), "probed_us": round(probed, 3),
                  "hit_us": round(probed - base, 3)}
        print(f"  {k:14s} call {base:7.3f} us   probed {probed:7.3f} us   hit {probed - base:7.3f} us", flush=True)
    return res


def entry_bytes(path: str, names: list[str] | None, name_filter: bytes | None = None,
                limit: int = 0) -> dict[str, str]:
    from stacklens.introspect.elf import ElfFile

    out = {}
    with ElfFile(path) as e, open(path, "rb") as f:
        want = None if names is None else {n.encode() for n in names}
        for name, value, _ in e.iter_symbols(name_filter=name_filter, names=want):
            off = e.vaddr_to_offset(value)
            if off is None or name in out:
                continue
            f.seek(off)
            out[name] = f.read(16).hex()
            if limit and len(out) >= limit:
                break
    return out


def first_op(hexbytes: str) -> str:
    """The kind of the first instruction: push (push %r, incl. REX.B push %r8-15), nop, nop5,
    "endbr64 + <next>", or other:<first bytes>; safe on short input."""
    b = bytes.fromhex(hexbytes)
    if b[:4] == bytes.fromhex("f30f1efa"):
        return "endbr64 + " + first_op(b[4:].hex())
    if (b and 0x50 <= b[0] <= 0x57) or (len(b) >= 2 and b[0] == 0x41 and 0x50 <= b[1] <= 0x57):
        return "push"
    if b[:1] == b"\x90":
        return "nop"
    if b[:5] == bytes.fromhex("0f1f440000"):
        return "nop5"
    return "other:" + b[:4].hex()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--calls", type=int, default=200_000)
    ap.add_argument("--prebuilt", help="a libsites.so built from this file's c_source()")
    ap.add_argument("--lib", action="append", default=[],
                    help="path of a libcuda / libamdhip64 library file to list (repeatable)")
    ap.add_argument("--torch", action="store_true", help="also list libtorch op entries (imports torch)")
    ap.add_argument("--no-timing", action="store_true")
    ap.add_argument("--json", help="write the results here")
    a = ap.parse_args()
    res: dict = {"kernel": os.uname().release}
    if not a.no_timing:
        with tempfile.TemporaryDirectory(prefix="stacklens-usites-") as workdir:
            lib = build(a.prebuilt, workdir)
            check_sites(lib)
            print(f"uprobe hit cost by entry instruction ({a.calls} calls each), kernel {res['kernel']}:")
            res["timing"] = timing(lib, a.calls)
    from stacklens.bpf.spec import load_specs

    symbols = list(dict.fromkeys(s.symbol for s in load_specs()))
    for lib in a.lib:
        got = entry_bytes(lib, symbols)
        res.setdefault("libs", {})[lib] = got
        print(f"{lib}: {len(got)} probed symbols")
        for n, h in sorted(got.items()):
            print(f"  {n:34s} {first_op(h):22s} {h}")
    if a.torch:
        import torch  # maps libtorch_*; with CUDA, initializing it maps libcuda

        if torch.cuda.is_available():
            torch.zeros(1, device="cuda")
            for line in open("/proc/self/maps"):
                p = line.split()[-1]
                if "/libcuda.so" in p and p not in res.setdefault("libs", {}):
                    got = entry_bytes(p, symbols)
                    res["libs"][p] = got
                    print(f"{p}: {len(got)} probed symbols")
                    for n, h in sorted(got.items()):
                        print(f"  {n:34s} {first_op(h):22s} {h}")

        for line in open("/proc/self/maps"):
            p = line.split()[-1]
            if p.endswith((".so",)) and "libtorch_" in p and p not in res.get("torch", {}):
                got = entry_bytes(p, None, name_filter=b"_ZN2at4_ops")
                got = {n: h for n, h in got.items() if "4callE" in n}
                kinds = collections.Counter(first_op(h).split(":")[0] for h in got.values())
                res.setdefault("torch", {})[p] = dict(kinds)
                print(f"{p}: {len(got)} op entries: {dict(kinds)}")
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
