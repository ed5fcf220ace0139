"""Discovery of libtorch operator entry points: exported `at::_ops::<op>::call` symbols.

Pure file reading (no privileges). libtorch_cpu.so's .dynsym is scanned once per
(path, inode, mtime) and the result cached in memory and on disk, so a second attach to any
process using the same torch skips the ~0.5 s scan.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

from .elf import SHT_DYNSYM, ElfFile

LIBTORCH_RE = re.compile(r"^libtorch_cpu\.so")
_PREFIX = "_ZN2at4_ops"
_LEN = re.compile(r"\d+")


@dataclass(frozen=True)
class OpSymbol:
    name: str       # "aten::addmm" (struct name of at::_ops, e.g. "aten::add_Tensor" for overloads)
    offset: int     # file offset of at::_ops::<op>::call


def op_name_from_mangled(sym: str) -> str | None:
    """`_ZN2at4_ops5addmm4callE...` -> "aten::addmm"; None for anything but `::call`.

    A minimal Itanium-ABI parser for this one nested-name shape (no c++filt process needed)."""
    if not sym.startswith(_PREFIX):
        return None
    m = _LEN.match(sym, len(_PREFIX))
    if not m:
        return None
    n = int(m.group())
    start = m.end()
    name = sym[start:start + n]
    if len(name) != n or not sym.startswith("4callE", start + n):
        return None
    return f"aten::{name}"


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "stacklens"


_MEMO: dict[tuple, list[OpSymbol]] = {}


def find_op_symbols(path: str, use_disk_cache: bool = True) -> list[OpSymbol]:
    """Every `at::_ops::*::call` in the file, sorted by name, one per distinct offset."""
    st = os.stat(path)
    key = (os.path.realpath(path), st.st_ino, st.st_mtime_ns, st.st_size)
    if key in _MEMO:
        return _MEMO[key]
    cache_file = _cache_dir() / f"ops-{st.st_ino}-{st.st_mtime_ns}-{st.st_size}.json"
    if use_disk_cache and cache_file.exists():
        try:
            ops = [OpSymbol(n, o) for n, o in json.loads(cache_file.read_text())]
            _MEMO[key] = ops
            return ops
        except (OSError, ValueError, TypeError):
            pass
    by_offset: dict[int, str] = {}
    with ElfFile(path) as elf:
        for sym, value, _ in elf.iter_symbols((SHT_DYNSYM,), name_filter=b"4callE"):
            name = op_name_from_mangled(sym)
            if name is None:
                continue
            off = elf.vaddr_to_offset(value)
            if off is not None and off not in by_offset:
                by_offset[off] = name
    ops = sorted((OpSymbol(n, o) for o, n in by_offset.items()), key=lambda s: s.name)
    _MEMO[key] = ops
    if use_disk_cache:
        try:
            cache_file.parent.mkdir(parents=True, exist_ok=True)
            tmp = cache_file.with_suffix(".tmp")
            tmp.write_text(json.dumps([[s.name, s.offset] for s in ops]))
            tmp.replace(cache_file)
        except OSError:
            pass
    return ops
