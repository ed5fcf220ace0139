"""Assembles the BPF C text compiled for one session: the shared header, the selected
`programs/*.bpf.c` parts, and -D parameters (never string-patched). `dump_bpf()` returns exactly
what is compiled, for `--dump-bpf`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

PROGRAMS = Path(__file__).with_name("programs")
_INCLUDE = re.compile(r'^#include "([\w.]+)"\s*$', re.M)


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


def build_source(pid: int, *, gpu: bool, ops: bool, cpu: bool, native_stacks: bool = True,
                 python_stacks: bool = False, pystack_cflags: tuple[str, ...] = (), max_specs: int = 64, ringbuf_pages: int = 4096,
                 api_stubs: int = 0, op_stubs: int = 0) -> ProgramSource:
    """api_stubs/op_stubs > 0 selects the per-probe fallback (kernels without uprobe_multi)."""
    parts = [p for p, on in (("gpu.bpf.c", gpu), ("ops.bpf.c", ops), ("cpu.bpf.c", cpu)) if on]
    seen: set[str] = set()
    text = "\n".join(_expand(p, seen, python_stacks) for p in parts)
    if api_stubs or op_stubs:
        lines = [f"SL_API_STUBS({i})" for i in range(api_stubs) if gpu]
        lines += [f"SL_OP_STUBS({i})" for i in range(op_stubs) if ops]
        text += "\n/* per-probe fallback stubs */\n" + "\n".join(lines) + "\n"
    cflags = [
        f"-DSL_TGID={int(pid)}",
        f"-DSL_MAX_SPECS={int(max_specs)}",
        f"-DSL_RINGBUF_PAGES={int(ringbuf_pages)}",
        f"-DSL_NATIVE_STACKS={1 if native_stacks else 0}",
        f"-I{PROGRAMS}",
    ]
    if api_stubs or op_stubs:
        cflags.append("-DSL_NO_COOKIE")
    if python_stacks:
        # layout and TLS parameters come from the Python-stack reader (bpf/python_process.py)
        cflags += ["-DSTACKLENS_PYSTACK", "-DSL_PYSTACK_MAPS", *pystack_cflags]
    return ProgramSource(text, tuple(cflags))


def pystack_available() -> bool:
    return (PROGRAMS / "pystack.h").exists()
