"""bpf.procmaps.NativeSymbolizer over a /proc tree written by the test: frames name functions, never
addresses (one frame per library for what no symbol covers), runs of them collapse, and
`exact_name` still names each address. Builds two small libraries with the C compiler (one
`gcc -s`); no root needed."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from stacklens.bpf import procmaps
from stacklens.bpf.procmaps import ANON, UNKNOWN, NativeSymbolizer, collapse_unsymbolized
from stacklens.cct import Frame
from stacklens.introspect.elf import SHT_SYMTAB, ElfFile

PID = 4242
SOURCE = r"""
#define INTERNAL static __attribute__((noinline))
static volatile int sink;
INTERNAL int inner_a(int x) { for (int i = 0; i < x; i++) sink += i * 3; return sink; }
INTERNAL int inner_b(int x) { for (int i = 0; i < x; i++) sink ^= i + 7; return sink; }
__attribute__((visibility("default"), noinline)) int sl_exported(int x) { return inner_a(x) + inner_b(x); }
"""
SYM_BASE, STRIPPED_BASE, ANON_BASE, VDSO_BASE = 0x10000000, 0x20000000, 0x30000000, 0x40000000


@pytest.fixture(scope="module")
def libs(tmp_path_factory):
    """The same code twice, with .symtab (libsym.so) and built with -s (libstripped.so), plus
    the file offsets of its functions (from the copy with symbols)."""
    cc = shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        pytest.skip("no C compiler to build the test libraries")
    d = tmp_path_factory.mktemp("symlibs")
    (d / "s.c").write_text(SOURCE)
    flags = ["-O1", "-fno-omit-frame-pointer", "-fPIC", "-shared"]
    subprocess.run([cc, *flags, "-o", str(d / "libsym.so"), str(d / "s.c")], check=True)
    subprocess.run([cc, *flags, "-s", "-o", str(d / "libstripped.so"), str(d / "s.c")], check=True)
    with ElfFile(d / "libsym.so") as elf:
        offsets = {name: elf.vaddr_to_offset(value) for name, value, _ in elf.iter_symbols((SHT_SYMTAB,))
                   if name in ("inner_a", "inner_b", "sl_exported")}
    with ElfFile(d / "libstripped.so") as elf:
        assert ".symtab" not in elf.sections
        exported = elf.symbols(["sl_exported"])["sl_exported"]
        # -s drops sections after the loaded ones: the code is where it is in libsym.so
        assert elf.vaddr_to_offset(exported) == offsets["sl_exported"]
    return d, offsets


@pytest.fixture
def proc(tmp_path, libs):
    """/proc/PID with maps and root/ holding the two libraries (and a mapped file that is gone)."""
    d, _ = libs
    root = tmp_path / "proc" / str(PID) / "root" / "opt"
    root.mkdir(parents=True)
    for name in ("libsym.so", "libstripped.so"):
        shutil.copy(d / name, root / name)
    size = max((d / n).stat().st_size for n in ("libsym.so", "libstripped.so"))
    end = lambda base: f"{base + ((size + 0xFFF) & ~0xFFF):08x}"  # noqa: E731
    (tmp_path / "proc" / str(PID) / "maps").write_text(
        f"{SYM_BASE:08x}-{end(SYM_BASE)} r-xp 00000000 08:01 11 /opt/libsym.so\n"
        f"{STRIPPED_BASE:08x}-{end(STRIPPED_BASE)} r-xp 00000000 08:01 12 /opt/libstripped.so\n"
        f"{ANON_BASE:08x}-{ANON_BASE + 0x10000:08x} r-xp 00000000 00:00 0 \n"
        f"{VDSO_BASE:08x}-{VDSO_BASE + 0x2000:08x} r-xp 00000000 00:00 0 [vdso]\n"
        "50000000-50010000 r-xp 00000000 08:01 13 /opt/libgone.so (deleted)\n"
        "60000000-60010000 rw-p 00000000 00:00 0 [heap]\n")
    return str(tmp_path / "proc")


def test_symbolized_frames_keep_their_names(proc, libs):
    _, off = libs
    s = NativeSymbolizer(PID, proc=proc)
    assert s.frame(SYM_BASE + off["inner_a"] + 3) == Frame.native("libsym.so", "inner_a")
    assert s.frame(SYM_BASE + off["sl_exported"]) == Frame.native("libsym.so", "sl_exported")
    # in the stripped copy the export is still in .dynsym
    assert s.frame(STRIPPED_BASE + off["sl_exported"] + 1) == Frame.native("libstripped.so", "sl_exported")


def test_unsymbolized_addresses_of_a_library_are_one_frame(proc, libs):
    """Internal functions of a stripped library: no per-address name (each would be a new CCT
    node) and not the export before them (that would name the wrong function)."""
    _, off = libs
    s = NativeSymbolizer(PID, proc=proc)
    frames = [s.frame(STRIPPED_BASE + off[f] + k) for f in ("inner_a", "inner_b") for k in (0, 5, 9)]
    assert set(frames) == {Frame.native("libstripped.so", "[stripped]")}
    assert all(f is frames[0] for f in frames)  # one object: the per-address cache holds no copies
    # a library with .symtab: an address between functions is "no symbol", not "stripped"
    assert s.frame(SYM_BASE + 0x10) == Frame.native("libsym.so", "[no symbol]")
    # a file that cannot be read: its library, no symbol
    assert s.frame(0x50000010) == s.frame(0x50000900) == Frame.native("libgone.so (deleted)", "[no symbol]")


def test_memory_without_a_file_and_unknown_addresses(proc):
    s = NativeSymbolizer(PID, proc=proc)
    assert s.frame(ANON_BASE + 0x10) == s.frame(ANON_BASE + 0x8000) == ANON == Frame.other("[anon]")
    assert s.frame(VDSO_BASE + 0x100) == Frame.other("[vdso]")
    assert s.frame(0x60000010) == UNKNOWN  # not executable: not in the symbolizer's maps
    assert s.frame(0x70000000) == s.frame(0x70000008) == Frame.other("[unknown]")
    assert UNKNOWN.label() == "[unknown]" and ANON.label() == "[anon]"


def test_exact_name_still_names_each_address(proc, libs):
    """What must stay apart per address (kernels named from a HIP host stub) keeps the old names."""
    _, off = libs
    s = NativeSymbolizer(PID, proc=proc)
    assert s.exact_name(STRIPPED_BASE + off["inner_a"]) == f"0x{off['inner_a']:x}"
    assert s.exact_name(STRIPPED_BASE + off["inner_b"]) == f"0x{off['inner_b']:x}"
    assert s.exact_name(SYM_BASE + off["inner_b"]) == "inner_b"
    assert s.exact_name(ANON_BASE + 0x10) == f"anon 0x{ANON_BASE + 0x10:x}"
    assert s.exact_name(VDSO_BASE + 0x100) == f"[vdso] 0x{VDSO_BASE + 0x100:x}"
    assert s.exact_name(0x70000000) == "unknown 0x70000000"


def test_stack_collapses_a_run_of_unsymbolized_frames(proc, libs):
    _, off = libs
    s = NativeSymbolizer(PID, proc=proc)
    a, b, exp = (STRIPPED_BASE + off[f] + 4 for f in ("inner_a", "inner_b", "sl_exported"))
    stripped = Frame.native("libstripped.so", "[stripped]")

    def stack(addrs):   # innermost first, as BPF returns them (the collapse native_frames does)
        return collapse_unsymbolized(s.frame(x) for x in reversed(addrs))

    assert stack([a, b, a, exp, b, a]) == (stripped, Frame.native("libstripped.so", "sl_exported"), stripped)
    assert stack([a, SYM_BASE + off["inner_a"], b]) == (stripped, Frame.native("libsym.so", "inner_a"), stripped)


def test_collapse_only_merges_equal_unsymbolized_neighbours():
    cuda, torch = Frame.native("libcuda.so.1", "[stripped]"), Frame.native("libtorch_cuda.so", "[stripped]")
    nosym = Frame.native("libcuda.so.1", "[no symbol]")
    f = Frame.native("libx.so", "f")
    assert collapse_unsymbolized([cuda, cuda, cuda]) == (cuda,)
    assert collapse_unsymbolized([torch, cuda, cuda, torch]) == (torch, cuda, torch)
    assert collapse_unsymbolized([cuda, nosym, nosym, cuda]) == (cuda, nosym, cuda)
    assert collapse_unsymbolized([f, f, cuda, f, cuda]) == (f, f, cuda, f, cuda)  # recursion stays
    assert collapse_unsymbolized([ANON, ANON]) == (ANON, ANON)  # not native: not this rule's
    assert collapse_unsymbolized(iter(())) == ()


def test_the_address_cache_is_bounded(proc, libs, monkeypatch):
    _, off = libs
    monkeypatch.setattr(procmaps, "CACHE_MAX", 8)
    s = NativeSymbolizer(PID, proc=proc)
    for k in range(50):
        s.frame(STRIPPED_BASE + off["inner_a"] + k)
        s.exact_name(ANON_BASE + k)
    assert len(s._cache) <= 8 and len(s._exact) <= 8
