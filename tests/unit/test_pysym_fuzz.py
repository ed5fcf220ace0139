"""pysym on hostile memory: random and truncated code objects, line tables and strings.

No privilege: the target is a `tests.fakes.memory.FakeMemory` (the `ProcessMemory` Protocol over
sparse regions; a read outside them raises MemoryReadError as an unmapped page does). What a
target's memory holds is untrusted: a code object freed and reused between the probe and the read
can hold anything. Nothing may raise out of `PySymbolizer.frame`; every bad object is counted by
kind and its frame marked (issue 26: one IndexError in `line_ranges_311` ended whole sessions).
The random cases run from fixed seeds: a failure names its seed and replays.
"""

from __future__ import annotations

import random
import struct
import sys

import pytest

from stacklens.cct import Frame
from stacklens.introspect import python_layouts as pl
from stacklens.pystacks.pysym import (SL_PYF_NOCODE, UNREADABLE_CODE, UNREADABLE_NAME, BadObject, PySymbolizer,
                                      RawPyFrame, RawPyStack, line_ranges_310, line_ranges_311)
from tests.fakes.memory import FakeMemory

CODE_TYPE = 0x9000
CODE, FILE, NAME, QUAL, TABLE = 0x100000, 0x200000, 0x210000, 0x220000, 0x300000
LAYOUTS = [pl.layout_for(v) for v in ((3, 10), (3, 11), (3, 12))]
SEEDS = range(40)


# ---- building objects ---------------------------------------------------------------------------

def varint(v: int) -> bytes:
    out = bytearray()
    while True:
        chunk, v = v & 63, v >> 6
        out.append(chunk | (64 if v else 0))
        if not v:
            return bytes(out)


def svarint(v: int) -> bytes:
    return varint((-v << 1 | 1) if v < 0 else v << 1)


def table_311_all_forms() -> bytes:
    """One entry of each 3.11+ form: long (14), no column (13), one line (10-12), short (0-9), none (15)."""
    return (bytes([0x80 | 14 << 3 | 2]) + svarint(3) + varint(1) + varint(5) + varint(9)
            + bytes([0x80 | 13 << 3 | 0]) + svarint(-2)
            + bytes([0x80 | 11 << 3 | 1, 4, 8])
            + bytes([0x80 | 3 << 3 | 0, 0x25])
            + bytes([0x80 | 15 << 3 | 3]))


def real_tables() -> list[bytes]:
    """Location tables of this interpreter's own functions (3.11+ format), when it has them."""
    if sys.version_info < (3, 11):
        return []
    return [f.__code__.co_linetable for f in (random.Random.shuffle, struct.pack.__class__.__init__,
                                              table_311_all_forms, pytest.approx)
            if hasattr(f, "__code__")]


def str_obj(lay, s: str, *, state: int | None = None, length: int | None = None) -> bytes:
    ascii_ = s.isascii()
    if state is None:
        state = (1 << 2) | (1 << 5) | ((1 if ascii_ else 0) << 6)
    data = s.encode("ascii" if ascii_ else "latin-1")
    head = bytearray(max(lay.unicode_compact_size, lay.unicode_ascii_size))
    struct.pack_into("<Q", head, lay.unicode_length, len(s) if length is None else length)
    struct.pack_into("<I", head, lay.unicode_state, state)
    return bytes(head[:lay.unicode_ascii_size if ascii_ else lay.unicode_compact_size]) + data


def bytes_obj(lay, data: bytes, *, size: int | None = None) -> bytes:
    head = bytearray(lay.bytes_sval)
    struct.pack_into("<Q", head, lay.bytes_size, len(data) if size is None else size)
    return bytes(head) + data


def code_obj(lay, *, first: int = 10, code_type: int = CODE_TYPE) -> bytes:
    buf = bytearray(512)
    struct.pack_into("<Q", buf, lay.ob_type, code_type)
    struct.pack_into("<Q", buf, lay.code_filename, FILE)
    struct.pack_into("<Q", buf, lay.code_name, NAME)
    if lay.code_qualname >= 0:
        struct.pack_into("<Q", buf, lay.code_qualname, QUAL)
    struct.pack_into("<i", buf, lay.code_firstlineno, first)
    struct.pack_into("<Q", buf, lay.code_linetable, TABLE)
    return bytes(buf)


def target(lay, *, table: bytes, code: bytes | None = None, file: bytes | None = None,
           name: bytes | None = None, qual: bytes | None = None, table_obj: bytes | None = None) -> FakeMemory:
    return FakeMemory({
        CODE: code if code is not None else code_obj(lay),
        FILE: file if file is not None else str_obj(lay, "/app/loader.py"),
        NAME: name if name is not None else str_obj(lay, "__iter__"),
        QUAL: qual if qual is not None else str_obj(lay, "DataLoader.__iter__"),
        TABLE: table_obj if table_obj is not None else bytes_obj(lay, table),
    })


def good_table(lay) -> bytes:
    return table_311_all_forms() if lay.linetable_format == 311 else bytes([4, 1, 6, 2, 2, 0x80])


TAG = FILE ^ NAME


def symbolize_all(sym: PySymbolizer, frames: list[RawPyFrame]) -> tuple[Frame, ...]:
    out = sym.symbolize(RawPyStack(0, False, tuple(frames)))
    assert len(out) == len(frames) and all(isinstance(f, Frame) for f in out)
    return out


def accounted(sym: PySymbolizer) -> int:
    st = sym.stats
    return st.hits + st.misses + st.stale + st.errors + st.bad_strings


# ---- line tables ------------------------------------------------------------------------------

@pytest.mark.parametrize("table", [table_311_all_forms()] + real_tables())
def test_every_truncation_of_a_location_table_raises_bad_object_or_decodes(table):
    """Cut at each byte: the prefix decodes (ending at an entry's end) or raises BadObject
    ("linetable"), never IndexError — what ended sessions on torch DataLoader targets."""
    whole = line_ranges_311(table, 10)
    for cut in range(len(table)):
        try:
            part = line_ranges_311(table[:cut], 10)
        except BadObject as e:
            assert e.kind == "linetable"
        else:
            assert part == whole[:len(part)]


@pytest.mark.parametrize("seed", SEEDS)
def test_random_bytes_as_line_tables(seed):
    rng = random.Random(seed)
    for _ in range(200):
        table = rng.randbytes(rng.randrange(0, 64))
        for decode in (line_ranges_311, line_ranges_310):
            try:
                ranges = decode(table, rng.randrange(-5, 1 << 20))
            except BadObject as e:
                assert decode is line_ranges_311 and e.kind == "linetable"
            else:
                assert all(isinstance(r, tuple) and len(r) == 3 for r in ranges)


# ---- whole code objects -------------------------------------------------------------------------

# 3.10's pairs cannot be told truncated (any even prefix is a table): 3.11+ here
@pytest.mark.parametrize("lay", [lay for lay in LAYOUTS if lay.linetable_format == 311],
                         ids=lambda lay: f"{lay.version[0]}.{lay.version[1]}")
def test_a_truncated_line_table_marks_the_line_and_is_counted(lay):
    table = good_table(lay)
    mem = target(lay, table=table[:3])       # cut inside the first (long form) entry
    sym = PySymbolizer(mem, lay, CODE_TYPE)
    fr = sym.frame(RawPyFrame(CODE, TAG, 8))
    assert fr == Frame.python("/app/loader.py", "DataLoader.__iter__" if lay.code_qualname >= 0 else "__iter__", 10)
    assert sym.stats.bad_linetables == 1 and sym.stats.errors == 0
    # not cached: the next frame reads it again (and counts again) — a torn read may heal
    sym.frame(RawPyFrame(CODE, TAG, 8))
    assert sym.stats.bad_linetables == 2 and sym.stats.hits == 0
    mem.regions[TABLE] = bytearray(bytes_obj(lay, table))
    good = sym.frame(RawPyFrame(CODE, TAG, 8))
    assert good.line != 10 and sym.stats.bad_linetables == 2


@pytest.mark.parametrize("lay", LAYOUTS, ids=lambda lay: f"{lay.version[0]}.{lay.version[1]}")
def test_bad_strings_mark_the_frame_and_are_counted(lay):
    cases = {
        "kind 3": str_obj(lay, "/app/x.py", state=(3 << 2) | (1 << 5)),
        "not compact": str_obj(lay, "/app/x.py", state=(1 << 2)),
        "too long": str_obj(lay, "/app/x.py", length=1 << 40),
        "length past the region": str_obj(lay, "/app/x.py", length=4000),
        "header cut": str_obj(lay, "/app/x.py")[:lay.unicode_state],
    }
    for why, bad in cases.items():
        # 3.10 has no co_qualname: its frames are named by co_name
        for field in ("file", "qual" if lay.code_qualname >= 0 else "name"):
            sym = PySymbolizer(target(lay, table=good_table(lay), **{field: bad}), lay, CODE_TYPE)
            assert sym.frame(RawPyFrame(CODE, TAG, 0)) == UNREADABLE_NAME, (why, field)
            assert sym.stats.bad_strings == 1 and sym.stats.errors == 0, (why, field)


@pytest.mark.parametrize("lay", LAYOUTS, ids=lambda lay: f"{lay.version[0]}.{lay.version[1]}")
def test_an_unreadable_header_is_an_unreadable_code_object(lay):
    sym = PySymbolizer(target(lay, table=b"", code=code_obj(lay)[:lay.code_filename]), lay, CODE_TYPE)
    assert sym.frame(RawPyFrame(CODE, TAG, 0)) == UNREADABLE_CODE
    assert sym.stats.errors == 1 and sym.stats.bad_strings == sym.stats.bad_linetables == 0


@pytest.mark.parametrize("lay", LAYOUTS, ids=lambda lay: f"{lay.version[0]}.{lay.version[1]}")
@pytest.mark.parametrize("table_obj", [b"\0" * 4, "absurd size", "past the region"])
def test_an_unreadable_line_table_keeps_the_function_at_its_first_line(lay, table_obj):
    if table_obj == "absurd size":
        table_obj = bytes_obj(lay, b"\x80", size=1 << 50)
    elif table_obj == "past the region":
        table_obj = bytes_obj(lay, b"\x80", size=4000)
    sym = PySymbolizer(target(lay, table=b"", table_obj=table_obj), lay, CODE_TYPE)
    assert sym.frame(RawPyFrame(CODE, TAG, 6)).line == 10
    assert sym.stats.bad_linetables == 1 and sym.stats.errors == 0


def random_code(lay, rng: random.Random) -> bytes:
    """A code object made of noise, with its pointer fields aimed at real regions now and then."""
    buf = bytearray(rng.randbytes(rng.choice((8, 64, 512))))
    for off in (lay.ob_type, lay.code_filename, lay.code_name, lay.code_qualname, lay.code_linetable):
        if off >= 0 and off + 8 <= len(buf) and rng.random() < 0.6:
            struct.pack_into("<Q", buf, off, rng.choice((CODE_TYPE, FILE, NAME, QUAL, TABLE, TABLE + 3, 0)))
    return bytes(buf)


def mangle(data: bytes, rng: random.Random) -> bytes:
    """Truncated, bit-flipped, or replaced by noise."""
    r = rng.random()
    if r < 0.3:
        return data[:rng.randrange(0, len(data) + 1)] or b"\0"
    if r < 0.6:
        b = bytearray(data)
        for _ in range(rng.randrange(1, 6)):
            i = rng.randrange(len(b))
            b[i] ^= 1 << rng.randrange(8)
        return bytes(b)
    if r < 0.8:
        return rng.randbytes(rng.randrange(1, 128))
    return data


def fuzz(lay, seed: int) -> dict[str, int]:
    """Random code objects, mangled strings and line tables, random tags, offsets and flags, 60
    targets of one seed: every frame comes back a Frame and is accounted for in the stats.
    Returns the bad objects counted, by kind."""
    rng = random.Random(seed)
    totals = {"bad_linetables": 0, "bad_strings": 0, "errors": 0}
    for _ in range(60):
        table = rng.choice([good_table(lay)] + real_tables())
        mem = target(lay, table=table,
                     code=random_code(lay, rng) if rng.random() < 0.3 else code_obj(lay, first=rng.randrange(-3, 1 << 31)),
                     file=mangle(str_obj(lay, "/app/loader.py"), rng),
                     qual=mangle(str_obj(lay, "DataLoader.__iter__"), rng),
                     name=mangle(str_obj(lay, "__iter__"), rng),
                     table_obj=mangle(bytes_obj(lay, mangle(table, rng)), rng))
        sym = PySymbolizer(mem, lay, rng.choice((CODE_TYPE, 0)), max_entries=rng.choice((1, 4, 64)))
        frames = [RawPyFrame(rng.choice((CODE, CODE + 8, 0, 0xdead0000)), rng.choice((TAG, 0, rng.getrandbits(64))),
                             rng.randrange(-4, 1 << 16), rng.choice((0, 1, SL_PYF_NOCODE)))
                  for _ in range(rng.randrange(1, 12))]
        symbolize_all(sym, frames)
        nocode = sum(1 for f in frames if not f.code or f.flags & SL_PYF_NOCODE)
        assert accounted(sym) == len(frames), (seed, sym.stats)
        assert sym.stats.errors >= nocode, (seed, sym.stats)
        for k in totals:
            totals[k] += getattr(sym.stats, k)
    return totals


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("lay", LAYOUTS, ids=lambda lay: f"{lay.version[0]}.{lay.version[1]}")
def test_random_and_mangled_objects_never_raise(lay, seed):
    assert sum(fuzz(lay, seed).values()) > 0


@pytest.mark.parametrize("lay", LAYOUTS, ids=lambda lay: f"{lay.version[0]}.{lay.version[1]}")
def test_the_fuzz_reaches_every_kind_of_bad_object(lay):
    """Over the seeds, each kind is met and counted (else the fuzz above tests less than it says)."""
    totals = {"bad_linetables": 0, "bad_strings": 0, "errors": 0}
    for seed in SEEDS:
        for k, n in fuzz(lay, seed).items():
            totals[k] += n
    assert all(totals.values()), totals
