"""Recorded rings (tests/data/rings/, written by its record.py) fed to a RingDecoder without root
or a live process: the decoder's maps, symbolizers and the target's memory answer from what the
live decoder read while the ring was recorded; anything it did not read raises."""

from __future__ import annotations

import base64
import gzip
import json
from dataclasses import dataclass
from pathlib import Path

from stacklens.bpf.decode import RingDecoder
from stacklens.bpf.spec import DEFAULT_SPEC, load_specs
from stacklens.cct import Frame
from stacklens.errors import MemoryReadError
from stacklens.introspect.python_layouts import PyLayout
from stacklens.pystacks.pysym import PySymbolizer

RINGS = Path(__file__).resolve().parents[1] / "data" / "rings"


def _bytes(s: str | None) -> bytes | None:
    return None if s is None else base64.b64decode(s)


class RecordedMemory:
    """ProcessMemory: the reads pysym made of the live target, by (address, length)."""

    def __init__(self, reads: list) -> None:
        self.reads = {(a, n): _bytes(b) for a, n, b in reads}

    def read(self, addr: int, n: int) -> bytes:
        b = self.reads.get((addr, n))
        if b is None:
            raise MemoryReadError(f"not readable when recorded: {addr:#x}+{n}")
        return b


class RecordedNative:
    """NativeSymbolizer's answers by address."""

    def __init__(self, frames: list, exact: list) -> None:
        self.frames = {a: Frame(*f) for a, f in frames}
        self.exact = dict(exact)

    def frame(self, addr: int) -> Frame:
        return self.frames[addr]

    def exact_name(self, addr: int) -> str:
        return self.exact[addr]


class RecordedMaps:
    """DecodeMaps: the stack, op-path and Python-stack map entries read while recording."""

    def __init__(self, doc: dict) -> None:
        self.stacks = {(t.encode(), k): v for t, k, v in doc["stacks"]}
        self.op_paths = {h: v for h, v in doc["op_paths"]}
        self.py_stacks = {i: _bytes(b) for i, b in doc["py_stacks"]}

    @staticmethod
    def _get(table: dict, key):
        v = table[key]
        if v is None:
            raise KeyError(key)        # not in the map when the live decoder asked
        return v

    def walk_stack(self, table: bytes, key: int):
        return iter(self._get(self.stacks, (table, key)))

    def op_path(self, h: int) -> tuple[int, ...]:
        return tuple(self._get(self.op_paths, h))

    def py_stack(self, pyid: int) -> bytes:
        return self._get(self.py_stacks, pyid)


class RecordedVtables:
    def __init__(self, names: list) -> None:
        self.names = dict(names)

    def name(self, vptr: int) -> str | None:
        return self.names[vptr]


@dataclass
class Ring:
    pid: int
    records: list[bytes]
    decoder: RingDecoder
    live: dict            # what the live decoder returned: events (as lists) and counts


def load(name: str) -> Ring:
    """A fresh decoder over recording `name` and its records."""
    doc = json.loads(gzip.decompress((RINGS / f"{name}.json.gz").read_bytes()))
    specs = load_specs(DEFAULT_SPEC) if doc["specs"] else []
    got = [[s.index, s.symbol] for s in specs][:len(doc["specs"])]
    assert got == doc["specs"], f"bpf/probes.toml changed since {name} was recorded: run tests/data/rings/record.py"
    py = None
    if doc["layout"] is not None:
        lay = dict(doc["layout"], version=tuple(doc["layout"]["version"]))
        py = PySymbolizer(RecordedMemory(doc["mem"]), PyLayout(**lay), doc["code_type_addr"])
    decoder = RingDecoder(doc["pid"], RecordedMaps(doc), RecordedNative(doc["frames"], doc["exact"]), specs=specs,
                          py=py, py_max_depth=doc["py_max_depth"], op_names=doc["op_names"],
                          vtables=RecordedVtables(doc["vtables"]))
    return Ring(doc["pid"], [base64.b64decode(r) for r in doc["records"]], decoder, doc["live"])


def as_lists(e) -> list:
    """An Event as record.py keeps the live ones."""
    def frames(fs):
        return [[f.kind, f.name, f.file, f.line] for f in fs]

    return [e.kind, e.api, e.kernel_name, e.bytes, e.direction, list(e.op_path), frames(e.py_stack),
            frames(e.native_stack), list(e.py_entries)]
