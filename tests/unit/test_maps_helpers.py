"""ElfFile.load_bias over procfs mappings (one tie-break), bpf.procmaps.find_libraries over
maps read once, and analyzer.view.op_of_native. No root needed."""

from __future__ import annotations

import os
import re

from stacklens.analyzer.view import op_base, op_of_native
from stacklens.bpf.procmaps import find_libraries
from stacklens.introspect.elf import ElfFile
from stacklens.introspect.procfs import Mapping, ProcFS


def _libc() -> tuple[Mapping, list[Mapping]]:
    maps = ProcFS().maps(os.getpid())
    libc = next(m for m in maps if "/libc.so" in m.path or "/libc-" in m.path)
    return libc, [m for m in maps if m.path == libc.path]


def test_load_bias_takes_mappings_and_the_lowest_start_wins_at_an_offset():
    libc, mine = _libc()
    with ElfFile(ProcFS().open_mapped_file(os.getpid(), libc)) as elf:
        real = elf.load_bias(mine)
        # a second mapping of the same offsets higher up (a file mapped twice): in either order
        # the lower one decides
        far = 1 << 40
        twice = [Mapping(m.start + far, m.end + far, m.perms, m.offset, m.inode, m.path, m.dev) for m in mine]
        assert elf.load_bias(twice + mine) == real
        assert elf.load_bias(iter(mine + twice)) == real  # any iterable
        assert elf.load_bias(twice) == real + far


def test_find_libraries_uses_given_maps_and_target_paths(tmp_path):
    pid = 4242
    maps = [
        Mapping(0x1000, 0x2000, "r-xp", 0, 11, "/usr/lib/libcuda.so.1", "08:01"),
        Mapping(0x3000, 0x4000, "r--p", 0x1000, 11, "/usr/lib/libcuda.so.1", "08:01"),  # same file
        Mapping(0x5000, 0x6000, "r-xp", 0, 12, "/opt/t/libtorch_cpu.so (deleted)", "08:01"),
        Mapping(0x7000, 0x8000, "rw-p", 0, 0, "", ""),
        Mapping(0x9000, 0xA000, "r-xp", 0, 0, "[vdso]", "00:00"),
    ]
    proc = str(tmp_path / "noproc")  # never read: the maps are given
    cuda = find_libraries(pid, re.compile(r"^libcuda\.so"), proc=proc, maps=maps)
    assert [(lib.path, lib.host_path, lib.key) for lib in cuda] == [
        ("/usr/lib/libcuda.so.1", f"{proc}/{pid}/root/usr/lib/libcuda.so.1", ("08:01", 11))]
    torch = find_libraries(pid, re.compile(r"libtorch_cpu"), proc=proc, maps=maps)
    assert [(lib.path, lib.host_path) for lib in torch] == [
        ("/opt/t/libtorch_cpu.so", f"{proc}/{pid}/root/opt/t/libtorch_cpu.so")]
    # without maps: read from proc, as before
    (tmp_path / "noproc" / str(pid)).mkdir(parents=True)
    (tmp_path / "noproc" / str(pid) / "maps").write_text(
        "00001000-00002000 r-xp 00000000 08:01 11 /usr/lib/libcuda.so.1\n")
    assert find_libraries(pid, re.compile(r"^libcuda"), proc=proc) == cuda


def test_op_of_native():
    assert op_of_native("at::_ops::select_int::call(at::Tensor const&, long, c10::SymInt)") == "aten::select_int"
    assert op_of_native("at::_ops::add_Tensor::redispatch(c10::DispatchKeySet, at::Tensor const&)") == \
        "aten::add_Tensor"
    assert op_base(op_of_native("at::_ops::as_strided::call(at::Tensor const&)")) == "as_strided"
    assert op_of_native("at::native::add(at::Tensor const&)") is None
    assert op_of_native("cuLaunchKernel") is None
    assert op_of_native("") is None


def test_fallback_records_decode_like_the_ring():
    """Records the ring refused (perf-buffer fallback) go through the ring decoder over one
    buffer (bpf.decode.RecordList): here name events, which need no BPF maps."""
    import struct

    from stacklens.bpf.events_abi import SL_EV_NAME, SL_NAME
    from stacklens.bpf.decode import EVENT_SIZE, RecordList, RingDecoder

    def name_rec(handle: int, name: bytes, ref: int = 0) -> bytes:
        # kind, spec, pid, tid, handle, ref, name (the session decodes its own process's records)
        r = struct.pack("<IIIIQQ", SL_EV_NAME, 0, os.getpid(), 0, handle, ref) + name.ljust(SL_NAME, b"\0")
        return r.ljust(EVENT_SIZE, b"\0")

    s = RingDecoder(os.getpid(), maps=None, native=None)
    recs = RecordList([name_rec(0x10, b"gemm_kernel"), name_rec(0x20, b"", ref=0x10),
                        name_rec(0x30, b"relu")])
    assert recs.positions() == (0, 3 * (8 + ((EVENT_SIZE + 7) & ~7)))
    assert s.decode(recs, 1 << 30) == []
    assert s.names == {0x10: "gemm_kernel", 0x20: "gemm_kernel", 0x30: "relu"}
