"""stacklens.introspect.elf (the one ELF reader) and stacklens.introspect.procfs maps on this process: no root needed."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from stacklens.introspect.elf import SHT_DYNSYM, ElfFile, SymbolTable
from stacklens.errors import AttachError, InputError, NotApplicable
from stacklens.introspect.procfs import ProcFS, parse_maps

SRC = """
int sl_counter = 42;
int sl_func_a(int x) { return x + sl_counter; }
int sl_func_b(int x) { return x * 2 + sl_func_a(x); }
"""


@pytest.fixture(scope="module")
def lib(tmp_path_factory):
    cc = shutil.which("cc") or shutil.which("gcc")
    if not cc:
        pytest.skip("needs cc")
    d = tmp_path_factory.mktemp("elf")
    (d / "t.c").write_text(SRC)
    out = d / "libsltest.so"
    subprocess.run([cc, "-shared", "-fPIC", "-O1", "-o", str(out), str(d / "t.c")], check=True)
    return out


def test_symbols_by_name_any_type_and_offsets(lib):
    with ElfFile(lib) as elf:
        syms = elf.symbols({"sl_counter", "sl_func_a", "missing"})
        assert set(syms) == {"sl_counter", "sl_func_a"}            # data symbols too
        offs = elf.symbol_offsets(["sl_counter", "sl_func_a", "sl_func_b"])
        assert set(offs) == {"sl_func_a", "sl_func_b"}             # functions only
        assert offs["sl_func_a"] == elf.vaddr_to_offset(syms["sl_func_a"])
        assert elf.offset_to_vaddr(offs["sl_func_a"]) == syms["sl_func_a"]
        assert ".dynsym" in elf.sections and ".text" in elf.sections
        assert elf.is_pie_or_shared and elf.segments
        names = {n for n, _, _ in elf.iter_symbols((SHT_DYNSYM,), name_filter=b"sl_func")}
        assert names == {"sl_func_a", "sl_func_b"}
        table = SymbolTable(elf)
    # the table outlives the file
    assert table.lookup(syms["sl_func_a"]) == "sl_func_a"
    assert table.lookup_offset(offs["sl_func_b"]) == "sl_func_b"


def test_load_bias_from_this_process_maps():
    """libc as mapped here: bias from the maps equals dlsym-free arithmetic on a known symbol."""
    maps = ProcFS().maps(os.getpid())
    libc = next(m for m in maps if "/libc.so" in m.path or "/libc-" in m.path)
    mine = [m for m in maps if m.path == libc.path]
    with ElfFile(ProcFS().open_mapped_file(os.getpid(), libc)) as elf:
        bias = elf.load_bias(mine)
        getpid = elf.symbols({"getpid"})["getpid"]
    import ctypes
    addr = ctypes.cast(ctypes.CDLL(None).getpid, ctypes.c_void_p).value
    assert addr == getpid + bias
    assert libc.dev and ":" in libc.dev


@pytest.mark.parametrize("error", [InputError, NotApplicable, AttachError])
def test_bad_files_raise_the_callers_error(tmp_path, error):
    for name, data in (("short", b"\x7fELF"), ("text", b"not an elf file at all" * 8),
                       ("elf32", b"\x7fELF\x01\x01" + b"\0" * 64),
                       ("truncated", b"\x7fELF\x02\x01\x01" + b"\0" * 25 + (10**6).to_bytes(8, "little")
                        + b"\0" * 16 + (1).to_bytes(2, "little") * 6)):
        p = tmp_path / name
        p.write_bytes(data)
        with pytest.raises(error):
            ElfFile(p, error=error)
    with pytest.raises(error, match="cannot open"):
        ElfFile(tmp_path / "missing", error=error)


def test_parse_maps_keeps_device_and_paths():
    text = ("7f00-7f10 r-xp 00001000 fd:01 1234   /usr/lib/libx.so (deleted)\n"
            "7f20-7f30 rw-p 00000000 00:00 0 \n")
    a, b = parse_maps(text)
    assert (a.start, a.offset, a.dev, a.inode, a.path) == (0x7F00, 0x1000, "fd:01", 1234, "/usr/lib/libx.so (deleted)")
    assert (b.dev, b.inode, b.path) == ("00:00", 0, "")
