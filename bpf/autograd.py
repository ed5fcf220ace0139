"""PyTorch autograd nodes as autograd.bpf.c sees them: the probed entry points, the layout of
`torch::autograd::Node` per torch version, and the class names of nodes from their vtables.

No privilege beyond reading the target's library files. The probes cost one uprobe hit per node a
forward op creates (with a Python stack walk) and one per node the engine evaluates.
"""

from __future__ import annotations

import bisect
import functools
import struct
from dataclasses import dataclass

from stacklens.introspect.demangle import demangle
from stacklens.introspect.elf import SHT_DYNSYM, SHT_SYMTAB, ElfFile, file_identity

# cookie = index (autograd.bpf.c SL_AG_NEW, SL_AG_EVAL)
NEW_SYMBOL = "_ZN5torch8autograd4impl17set_gradient_edgeERKN2at6TensorENS0_4EdgeE"
EVAL_SYMBOL = ("_ZN5torch8autograd6Engine17evaluate_functionERSt10shared_ptrINS0_9GraphTaskEEPNS0_4NodeE"
               "RNS0_11InputBufferERKS2_INS0_10ReadyQueueEE")
SYMBOLS = (NEW_SYMBOL, EVAL_SYMBOL)
_U64 = struct.Struct("<Q")


@dataclass(frozen=True)
class NodeLayout:
    """Where `torch::autograd::Node` keeps `sequence_nr_` and `thread_id_` (byte offsets)."""

    name: str
    seq: int
    thread: int


# torch/csrc/autograd/node.h (function.h before): the vtable pointer, the base class, then
# sequence_nr_, topological_nr_, has_parent_ (padded to 8), thread_id_.
INTRUSIVE = NodeLayout("c10::intrusive_ptr_target base (torch >= 2.13)", seq=16, thread=40)
SHARED = NodeLayout("std::enable_shared_from_this base (torch < 2.13)", seq=24, thread=48)


def node_layout(blob: bytes, node: int) -> NodeLayout:
    """The layout of the node at address `node` whose first bytes are `blob`.

    A node owned through std::shared_ptr (enable_shared_from_this) holds `weak_this` = {this,
    control block} right after its vtable pointer; an intrusive_ptr_target holds its reference
    counts there (two small 32-bit counts, never the node's own address)."""
    return SHARED if _U64.unpack_from(blob, 8)[0] == node else INTRUSIVE


def decode_node(blob: bytes, node: int) -> tuple[int, int, int, NodeLayout]:
    """(vtable pointer, sequence number, forward thread id, layout) from a node's first bytes."""
    lay = node_layout(blob, node)
    return (_U64.unpack_from(blob, 0)[0], _U64.unpack_from(blob, lay.seq)[0],
            _U64.unpack_from(blob, lay.thread)[0], lay)


def class_name(demangled_vtable: str) -> str:
    """'vtable for torch::autograd::generated::AddmmBackward0' -> 'AddmmBackward0';
    templates keep their arguments: 'CppNode<MyFunction>'."""
    name = demangled_vtable.removeprefix("vtable for ")
    depth, cut = 0, 0
    for i, ch in enumerate(name):
        if ch == "<":
            depth += 1
        elif ch == ">":
            depth -= 1
        elif ch == ":" and depth == 0 and name.startswith("::", i):
            cut = i + 2
    return name[cut:] or name


@functools.lru_cache(maxsize=16)
def _vtables(identity: tuple, symtab: bool) -> tuple[tuple[int, int, str], ...]:
    """(value, size, class name) of the vtables of torch::autograd classes (nodes live there:
    generated::*, AccumulateGrad, PyNode, CppNode<...>, CopySlices, ...) in one version of a
    file, read once per process (~0.6 s for libtorch_cpu on the 2-vCPU machine)."""
    out = []
    with ElfFile(identity[0]) as elf:
        for sym, value, size in elf.iter_symbols((SHT_DYNSYM, SHT_SYMTAB) if symtab else (SHT_DYNSYM,),
                                                 funcs_only=False, name_filter=b"8autograd"):
            if sym.startswith("_ZTV") and size >= 24:
                out.append((value, size, class_name(demangle(sym))))
    return tuple(out)


class VtableNames:
    """Node class names by vtable pointer, for the library files of one process.

    `add(host_path, bias)` reads a file's vtable symbols once (about 1,300 in libtorch_cpu 2.13, ~0.1 s);
    `name(vptr)` answers from them, or "" for a pointer into no added file."""

    def __init__(self) -> None:
        self._starts: list[int] = []
        self._tables: list[tuple[int, int, dict[int, str]]] = []   # (start, end, {vptr: name})

    def add(self, host_path: str, bias: int, *, symtab: bool = False) -> int:
        """symtab: also the static symbol table (libtorch_python hides PyNode's vtable there)."""
        names: dict[int, str] = {}
        lo, hi = 1 << 64, 0
        for value, size, name in _vtables(file_identity(host_path), symtab):
            # the object's vptr points past offset-to-top and the typeinfo pointer
            names.setdefault(bias + value + 16, name)
            lo, hi = min(lo, bias + value), max(hi, bias + value + size)
        if names:
            i = bisect.bisect(self._starts, lo)
            self._starts.insert(i, lo)
            self._tables.insert(i, (lo, hi, names))
        return len(names)

    def name(self, vptr: int) -> str:
        i = bisect.bisect(self._starts, vptr) - 1
        if i < 0:
            return ""
        lo, hi, names = self._tables[i]
        return names.get(vptr, "") if vptr < hi else ""
