"""Assembles the BPF C text compiled for one session: the shared header, the selected
`programs/*.bpf.c` parts, and -D parameters (never string-patched). `ProbeSession.source` returns
exactly what a session compiled.

`compile_bpf` is the one place a BCC module is made: BCC's compile (clang/LLVM inside
`bcc.BPF(...)`) is not thread-safe, and two sessions compiling at once crashed the daemon (SIGSEGV,
`malloc_consolidate()`; issue 17). One process-wide lock serialises making, loading programs of and
destroying BCC modules; everything else an attach does (symbol scans, uprobe attaches, ring
buffers) runs in parallel across PIDs. A compile costs ~2-3 s of CPU on an idle 2-vCPU VM, so N
concurrent attaches finish in about N compiles.
"""

from __future__ import annotations

import re
import threading
from dataclasses import dataclass
from pathlib import Path

PROGRAMS = Path(__file__).with_name("programs")
_INCLUDE = re.compile(r'^#include "([\w.]+)"\s*$', re.M)

# Held while BCC makes, loads from or destroys a module (LLVM state is process-global). Reentrant:
# BPF.__init__ loads its auto-attached functions through load_func.
BCC_LOCK = threading.RLock()
_LOCKED_BPF = None


@dataclass(frozen=True)
class ProgramSource:
    text: str
    cflags: tuple[str, ...]

    def render(self) -> str:
        flags = " ".join(self.cflags)
        return f"/* stacklens BPF program; compiled with cflags: {flags} */\n{self.text}"


def _expand(name: str, seen: set[str], pystack: bool = False) -> str:
    """Inline local `#include "x.h"` files found in programs/ (once each): BCC rewrites map
    calls only in main-file text. pystack.h is inlined only when Python stacks are on."""
    path = PROGRAMS / name
    text = path.read_text()

    def sub(m: re.Match) -> str:
        inc = m.group(1)
        if inc == "pystack.h" and not pystack:
            return m.group(0)  # inside #ifdef STACKLENS_PYSTACK: never compiled
        if inc in seen or not (PROGRAMS / inc).exists():
            return ""
        seen.add(inc)
        return f"/* ---- {inc} ---- */\n{_expand(inc, seen, pystack)}"

    return _INCLUDE.sub(sub, text)


MAX_TARGETS = 64   # processes one compiled program serves at once (stacklens.h SL_MAX_TARGETS)


def build_source(*, gpu: bool, ops: bool, cpu: bool, native_stacks: bool = True,
                 python_stacks: bool = False, pystack_cflags: tuple[str, ...] = (), max_specs: int = 64, ringbuf_pages: int = 4096,
                 api_stubs: int = 0, op_stubs: int = 0, autograd: bool = False) -> ProgramSource:
    """The program for every process with these settings (nothing in it names a process: the
    targets it serves are entries of its `targets` map, bpf/shared.py). api_stubs/op_stubs > 0
    selects the per-probe fallback (kernels without uprobe_multi). autograd: the
    forward→backward link's probes (autograd.bpf.c), with the operator probes."""
    parts = [p for p, on in (("gpu.bpf.c", gpu), ("ops.bpf.c", ops), ("cpu.bpf.c", cpu),
                             ("autograd.bpf.c", ops and autograd)) if on]
    seen: set[str] = set()
    text = "\n".join(_expand(p, seen, python_stacks) for p in parts)
    if api_stubs or op_stubs:
        lines = [f"SL_API_STUBS({i})" for i in range(api_stubs) if gpu]
        lines += [f"SL_OP_STUBS({i})" for i in range(op_stubs) if ops]
        text += "\n/* per-probe fallback stubs */\n" + "\n".join(lines) + "\n"
    cflags = [
        f"-DSL_MAX_TARGETS={MAX_TARGETS}",
        f"-DSL_MAX_SPECS={int(max_specs)}",
        f"-DSL_RINGBUF_PAGES={int(ringbuf_pages)}",
        f"-DSL_NATIVE_STACKS={1 if native_stacks else 0}",
        f"-I{PROGRAMS}",
    ]
    if api_stubs or op_stubs:
        cflags.append("-DSL_NO_COOKIE")
    if python_stacks:
        # layout and TLS parameters come from the Python-stack reader (pystacks/python_process.py)
        cflags += ["-DSTACKLENS_PYSTACK", "-DSL_PYSTACK_MAPS", *pystack_cflags]
    return ProgramSource(text, tuple(cflags))


def pystack_available() -> bool:
    return (PROGRAMS / "pystack.h").exists()


def _locked_bpf_class():
    """`bcc.BPF` whose module is made, loaded from and destroyed under BCC_LOCK."""
    global _LOCKED_BPF
    if _LOCKED_BPF is None:
        from bcc import BPF  # imported here: no import-time side effects, tests without bcc still import

        class LockedBPF(BPF):
            def __init__(self, *args, **kwargs):
                with BCC_LOCK:
                    super().__init__(*args, **kwargs)

            def load_func(self, *args, **kwargs):
                with BCC_LOCK:
                    return super().load_func(*args, **kwargs)

            def close(self):
                with BCC_LOCK:
                    super().close()

        _LOCKED_BPF = LockedBPF
    return _LOCKED_BPF


def compile_bpf(src: ProgramSource):
    """Compiles `src` with BCC, one compile at a time in this process; returns the `bcc.BPF`."""
    return _locked_bpf_class()(text=src.text.encode(), cflags=list(src.cflags))
