"""Discovery of libtorch operator entry points: exported `at::_ops::<op>::call` symbols.

Pure file reading (no privileges). libtorch_cpu.so's .dynsym is scanned once per
(path, inode, mtime) and the result cached in memory and on disk, so a second attach to any
process using the same torch skips the ~0.5 s scan.

`VIEW_OPS` is the default exclusion list: ops that only make a view or read metadata (no
kernel, no storage allocation, no synchronization). `select_ops` applies it. `FALLBACK_OPS` is
the short list probed where uprobe_multi is unavailable (bpf/scan.py).
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

from stacklens.introspect.elf import SHT_DYNSYM, ElfFile

LIBTORCH_RE = re.compile(r"^libtorch_cpu\.so")
_PREFIX = "_ZN2at4_ops"
_LEN = re.compile(r"\d+")


# Not probed by default (`ProbeConfig.all_ops=True` probes them). Each one returns an alias of
# its input's storage, changes metadata in place, or reads metadata: no kernel, no storage
# allocation, no synchronization. On the tiny MLP of benchmarks/bench_probes.py they are 49 of
# the 92 op calls per step; each uprobe hit costs ~0.9 µs on the 2-core VM whatever the program
# does (docs/benchmarks/probes.md). Exact at::_ops names, overload suffix included.
# Kept probed on purpose: ops that can copy (reshape, reshape_as, flatten_using_ints, contiguous,
# clone, *_copy), ops that read tensor data (narrow_Tensor, tensor_split_tensor_indices_or_sections,
# is_nonzero, item), split/unbind/chunk-style ops. resolve_conj/resolve_neg are excluded: for a
# tensor without the conj/neg bit they return it as is, and with the bit set their copy is an
# aten::clone call, which stays probed (it shows up under the caller's op instead).
VIEW_OPS: frozenset[str] = frozenset("aten::" + n for n in (
    # views of the same storage
    "alias", "as_strided", "_reshape_alias", "_unsafe_view", "view", "view_dtype", "view_as",
    "expand", "expand_as", "t", "transpose_int", "numpy_T", "mT", "mH", "matrix_H", "adjoint",
    "permute", "swapaxes", "swapdims", "movedim_int", "movedim_intlist", "moveaxis_int",
    "moveaxis_intlist", "unsqueeze", "squeeze", "squeeze_dim", "squeeze_dims",
    "select_int", "slice_Tensor", "narrow", "diagonal", "unfold",
    "detach", "_conj", "conj", "_neg_view", "real", "imag", "view_as_real", "view_as_complex",
    "resolve_conj", "resolve_neg", "positive", "lift_fresh",
    # the same, in place (metadata only)
    "as_strided_", "t_", "transpose_", "swapaxes_", "swapdims_", "unsqueeze_", "squeeze_",
    "squeeze__dim", "squeeze__dims", "detach_",
    # metadata reads
    "size_int", "stride_int", "sym_size_int", "sym_stride_int", "sym_numel", "sym_storage_offset",
    "numel", "dim", "is_contiguous", "is_contiguous_memory_format", "sym_is_contiguous",
    "is_complex", "is_floating_point", "is_signed", "is_conj", "is_neg", "is_inference", "is_leaf",
    "_is_zerotensor", "output_nr", "_version", "retains_grad", "result_type_Tensor",
    "result_type_Scalar", "result_type_Scalar_Tensor", "result_type_Scalar_Scalar", "can_cast",
    "promote_types",
))

# ops attached when uprobe_multi is unavailable (one perf event each: slow to attach and detach)
FALLBACK_OPS = ("aten::linear", "aten::addmm", "aten::matmul", "aten::mm", "aten::bmm", "aten::conv2d",
                "aten::convolution", "aten::relu", "aten::softmax_int", "aten::layer_norm",
                "aten::embedding", "aten::add_Tensor", "aten::mul_Tensor", "aten::copy_",
                "aten::to_dtype", "aten::t", "aten::mse_loss", "aten::sum", "aten::item")
# (aten::t is a VIEW_OPS op: select_ops leaves it out unless all_ops / an op_filter asks for it)


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
    """systemd's CacheDirectory= (the unit's /var/cache/stacklens: its home is read-only there),
    else the user's XDG cache."""
    unit_cache = os.environ.get("CACHE_DIRECTORY", "").split(":")[0]
    if unit_cache:
        return Path(unit_cache)
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


def select_ops(ops: list[OpSymbol], op_filter: str = "", all_ops: bool = False) -> list[OpSymbol]:
    """The ops a session probes: `op_filter` (a regex searched in the op name) when given, over
    every op; else every op, less `VIEW_OPS` unless `all_ops`."""
    if op_filter:
        rx = re.compile(op_filter)
        return [o for o in ops if rx.search(o.name)]
    if all_ops:
        return list(ops)
    return [o for o in ops if o.name not in VIEW_OPS]
