"""python_layouts (the one version table) and pysym (line tables, strings, cache) on fakes.

No privilege: target memory is a dict (FakeMemory); interpreters other than the running one are
only run as subprocesses that print their own line tables.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys

import pytest

from tests.interpreters import pyenv_python
from stacklens.introspect import python_layouts as pl
from stacklens.pystacks.python_process import bpf_defines
from stacklens.pystacks.pysym import PySymbolizer, RawPyFrame, RawPyStack, line_of, line_ranges_310, line_ranges_311
from stacklens.cct import Frame
from stacklens.errors import MemoryReadError, UnsupportedVersion
from stacklens.introspect.debug_offsets import DEBUG_COOKIE

INTERPRETERS = {
    (3, 10): pyenv_python("3.10.13"),
    (3, 11): pyenv_python("3.11.7"),
    (3, 12): pyenv_python("3.12.1"),
    (3, 13): pyenv_python("3.13.0"),
}


# ---- the table -------------------------------------------------------------------------------

@pytest.mark.parametrize("version", [(3, 9), (3, 15), (2, 7), (4, 0)])
def test_unknown_versions_are_refused(version):
    with pytest.raises(UnsupportedVersion, match="not supported"):
        pl.layout_for(version)


@pytest.mark.parametrize("version", [(3, 10), (3, 11), (3, 12)])
def test_tables_for_310_to_312(version):
    lay = pl.layout_for(version)
    assert lay.version == version and lay.source == "table"
    assert lay.frame_read_size() >= lay.frame_instr + 4
    assert abs(lay.code_filename - lay.code_name) == 8
    d = bpf_defines(lay)
    assert d["SL_PY_F_READ"] % 8 == 0 and d["SL_PY_CODE_TAG_OFF"] == lay.code_filename


def test_free_threaded_refused_by_name():
    with pytest.raises(UnsupportedVersion, match="free-threaded"):
        pl.layout_for((3, 13), b"", free_threaded=True)


def debug_blob(version, hexversion=None, free_threaded=0, cookie=DEBUG_COOKIE, **over):
    spec = pl.LAYOUTS[version]
    vals = []
    for i, name in enumerate(spec.field_order):
        group, field = name.split(".")
        vals.append(over.get(name, 4096 if field == "size" else 8 * (i % 40)))
    hv = hexversion if hexversion is not None else (version[0] << 24 | version[1] << 16 | 0xF0)
    return cookie + struct.pack("<QQ", hv, free_threaded) + struct.pack(f"<{len(vals)}Q", *vals)


@pytest.mark.parametrize("version", [(3, 13), (3, 14)])
def test_debug_offsets_parsed(version):
    blob = debug_blob(version, **{"thread_state.current_frame": 72,
                                  "interpreter_frame.owner": 70,
                                  "code_object.co_code_adaptive": 200})
    assert len(blob) == pl.debug_offsets_size(version)
    lay = pl.layout_for(version, blob)
    assert lay.source == "_Py_DebugOffsets" and lay.version == version
    assert (lay.tstate_frame, lay.frame_owner, lay.code_adaptive) == (72, 70, 200)
    assert lay.cframe_current_frame == -1 and lay.owner_shim_min == 3


def test_debug_offsets_cookie_version_and_free_threading_checked():
    with pytest.raises(UnsupportedVersion, match="xdebugpy"):
        pl.layout_for((3, 13), debug_blob((3, 13), cookie=b"notdebug"))
    with pytest.raises(UnsupportedVersion, match="says 3.14"):
        pl.layout_for((3, 13), debug_blob((3, 13), hexversion=0x030E00F0))
    with pytest.raises(UnsupportedVersion, match="free-threaded"):
        pl.layout_for((3, 13), debug_blob((3, 13), free_threaded=1))
    with pytest.raises(UnsupportedVersion, match="outside its struct"):
        pl.layout_for((3, 13), debug_blob((3, 13), **{"code_object.size": 16,
                                                      "code_object.filename": 112}))


def test_unknown_version_in_debug_offsets_refused():
    blob = debug_blob((3, 13), hexversion=0x030F00A0)  # 3.15: not in the table
    with pytest.raises(UnsupportedVersion, match="3.15 is not supported"):
        pl.parse_debug_offsets(blob)


# ---- line tables: decoded exactly like each interpreter's own co_lines() ----------------------

DUMP = r"""
import json, sys, textwrap
src = textwrap.dedent('''
def f(a, b):
    x = a + b

    if x > 3:
        for i in range(x):
            x += i * 2
    else:
        x = [j for j in range(10)
             if j % 2]
    try:
        1 / 0
    except ZeroDivisionError:
        pass
    return (x,
            a)
''')
ns = {}
exec(compile(src, "t.py", "exec"), ns)
out = []
for co in [ns["f"].__code__] + [c for c in ns["f"].__code__.co_consts if hasattr(c, "co_code")]:
    out.append({"table": co.co_linetable.hex(), "first": co.co_firstlineno,
                "lines": [list(t) for t in co.co_lines()]})
print(json.dumps(out))
"""


@pytest.mark.parametrize("version", sorted(INTERPRETERS))
def test_line_tables_match_interpreter(version):
    exe = INTERPRETERS[version] if sys.version_info[:2] != version else sys.executable
    if not os.path.exists(exe):
        pytest.skip(f"{exe} not installed")
    codes = json.loads(subprocess.run([exe, "-c", DUMP], capture_output=True, text=True,
                                      check=True).stdout)
    decode = line_ranges_310 if version == (3, 10) else line_ranges_311
    for co in codes:
        ranges = decode(bytes.fromhex(co["table"]), co["first"])
        for start, end, line in co["lines"]:
            for byte in range(start, end, 2):
                want = line if line is not None else co["first"]
                assert line_of(ranges, byte // 2, co["first"]) == want, (version, byte)


# ---- symbolization on fake memory -------------------------------------------------------------

class FakeMemory:
    def __init__(self):
        self.mem: dict[int, int] = {}
        self.reads = 0

    def put(self, addr: int, data: bytes) -> None:
        for i, b in enumerate(data):
            self.mem[addr + i] = b

    def read(self, addr: int, n: int) -> bytes:
        self.reads += 1
        try:
            return bytes(self.mem[addr + i] for i in range(n))
        except KeyError:
            raise MemoryReadError(f"unmapped {addr:#x}") from None


LAY = pl.layout_for((3, 11))
CODE_TYPE = 0x9000


def put_str(m: FakeMemory, addr: int, s: str) -> int:
    ascii_ = s.isascii()
    state = (1 << 2) | (1 << 5) | ((1 if ascii_ else 0) << 6)
    m.put(addr, b"\0" * LAY.unicode_compact_size)
    m.put(addr + LAY.unicode_length, struct.pack("<Q", len(s)))
    m.put(addr + LAY.unicode_state, struct.pack("<I", state))
    data = s.encode("ascii" if ascii_ else "latin-1")
    m.put(addr + (LAY.unicode_ascii_size if ascii_ else LAY.unicode_compact_size), data)
    return addr


def put_code(m: FakeMemory, addr: int, file: str, qual: str, first: int, table: bytes,
             objs: int = 0) -> int:
    objs = objs or addr + 0x1000
    fn, name, q, lt = objs, objs + 0x1000, objs + 0x2000, objs + 0x3000
    m.put(addr, b"\0" * 256)
    m.put(addr + LAY.ob_type, struct.pack("<Q", CODE_TYPE))
    m.put(addr + LAY.code_filename, struct.pack("<Q", put_str(m, fn, file)))
    m.put(addr + LAY.code_name, struct.pack("<Q", put_str(m, name, qual.split(".")[-1])))
    m.put(addr + LAY.code_qualname, struct.pack("<Q", put_str(m, q, qual)))
    m.put(addr + LAY.code_firstlineno, struct.pack("<i", first))
    m.put(lt + LAY.bytes_size, struct.pack("<Q", len(table)))
    m.put(lt + LAY.bytes_sval, table)
    m.put(addr + LAY.code_linetable, struct.pack("<Q", lt))
    return fn ^ name  # the tag BPF would record


def table_311(*entries):
    """(length_in_units, line_delta) entries in the 'no column' form (code 13)."""
    out = b""
    for length, delta in entries:
        v = (-delta << 1 | 1) if delta < 0 else delta << 1
        out += bytes([0x80 | (13 << 3) | (length - 1), v])
    return out


def test_symbolize_order_lines_and_truncation():
    m = FakeMemory()
    tag_a = put_code(m, 0x100000, "/app/train.py", "step", 40, table_311((3, 1), (4, 2)))
    tag_b = put_code(m, 0x200000, "/app/mödel.py", "Net.forward", 10, table_311((2, 7)))
    s = PySymbolizer(m, LAY, CODE_TYPE)
    raw = RawPyStack(0, True, (RawPyFrame(0x200000, tag_b, 2), RawPyFrame(0x100000, tag_a, 8)))
    fr = s.symbolize(raw)
    assert fr[0] == Frame.other("[truncated]")
    assert fr[1] == ("python", "step", "/app/train.py", 43)
    assert fr[2] == ("python", "Net.forward", "/app/mödel.py", 17)


def test_cache_hits_and_reuse_detection():
    m = FakeMemory()
    tag = put_code(m, 0x100000, "/app/a.py", "f", 1, table_311((4, 0)))
    s = PySymbolizer(m, LAY, CODE_TYPE)
    raw = RawPyFrame(0x100000, tag, 0)
    s.frame(raw)
    reads = m.reads
    for _ in range(10):
        assert s.frame(raw).name == "f"
    assert m.reads == reads and s.stats.hits == 10 and s.stats.misses == 1
    # the code object dies and another one (other file, other name) takes its address
    tag2 = put_code(m, 0x100000, "/app/b.py", "g", 5, table_311((4, 0)), objs=0x700000)
    assert tag2 != tag
    assert s.frame(RawPyFrame(0x100000, tag2, 0)) == ("python", "g", "/app/b.py", 5)
    # an event recorded before the reuse cannot be read any more: marked, not misnamed
    s2 = PySymbolizer(m, LAY, CODE_TYPE)
    assert s2.frame(RawPyFrame(0x100000, tag, 0)) == Frame.other("[stale code object]")
    assert s2.stats.stale == 1


def test_unreadable_and_non_code_objects_are_marked():
    m = FakeMemory()
    s = PySymbolizer(m, LAY, CODE_TYPE)
    assert s.frame(RawPyFrame(0xdead000, 1, 0)) == Frame.other("[unreadable code object]")
    m.put(0x500000, b"\0" * 256)  # ob_type is not PyCode_Type
    assert s.frame(RawPyFrame(0x500000, 0, 0)) == Frame.other("[stale code object]")
    assert s.frame(RawPyFrame(0, 0, 0)) == Frame.other("[unknown python frame]")


def test_raw_stack_from_bytes_roundtrip():
    from stacklens.pystacks.pysym import sl_pystack_struct
    st = sl_pystack_struct(4)()
    st.depth, st.status, st.truncated = 2, 0, 1
    st.frames[0].code, st.frames[0].tag, st.frames[0].offset, st.frames[0].flags = 1, 2, 3, 1
    st.frames[1].code = 5
    raw = RawPyStack.from_bytes(bytes(st), 4)
    assert raw == RawPyStack(0, True, (RawPyFrame(1, 2, 3, 1), RawPyFrame(5, 0, 0, 0)))
