"""Pure parts of the bpf package: probe spec, argument decoding, ELF reader, op names (no root)."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from stacklens.introspect.elf import ElfFile, SymbolTable
from stacklens.bpf.events_abi import SlEvent
from stacklens.bpf.ops import op_name_from_mangled
from stacklens.bpf.program import build_source
from stacklens.bpf.spec import load_specs
from stacklens.errors import InputError


def _spec(symbol):
    return next(s for s in load_specs() if s.symbol == symbol)


def test_probes_toml_covers_the_issue_symbols():
    names = {s.symbol for s in load_specs()}
    for sym in ("cuLaunchKernel", "cuLaunchKernelEx", "cuLaunchCooperativeKernel",
                "cuGraphLaunch", "cuMemAlloc_v2", "cuMemAllocAsync", "cuMemFree_v2", "cuMemcpyHtoD_v2",
                "cuStreamSynchronize", "cuCtxSynchronize", "cuEventSynchronize", "cuModuleGetFunction",
                "cuLibraryGetKernel", "cuKernelGetFunction", "hipLaunchKernel", "hipModuleLaunchKernel",
                "hipExtLaunchKernel", "hipMalloc", "hipFree", "hipMemcpy", "hipStreamSynchronize",
                "hipDeviceSynchronize"):
        assert sym in names
    # launch paths are entry-only
    assert not any(s.ret for s in load_specs() if s.kind in ("launch", "graph"))


def test_cuLaunchKernel_stack_arguments():
    s = _spec("cuLaunchKernel").bpf_spec()
    assert s.nargs == 11
    # f, grid xyz, block x y in registers; block_z, shared, stream, params, extra on the stack
    assert list(s.src[:11]) == list(range(11)) and s.src[11] == 255


def test_dim3_and_struct_decoding():
    hip = _spec("hipLaunchKernel")
    args = [0xAB, (20 << 32) | 10, 30, (2 << 32) | 64, 1, 0, 512, 0x4242] + [0] * 4
    d = hip.decode(args, b"")
    assert (d["grid_x"], d["grid_y"], d["grid_z"], d["block_x"], d["block_y"], d["block_z"]) == (10, 20, 30, 64, 2, 1)
    assert d["shared_mem"] == 512 and d["stream"] == 0x4242
    ex = _spec("cuLaunchKernelEx")
    import struct
    blob = struct.pack("<7I4xQQI12x", 7, 8, 9, 32, 4, 2, 4096, 0x5353, 0, 0)
    d = ex.decode([0x1000, 0xF, 0, 0] + [0] * 8, blob)
    assert (d["grid_z"], d["block_z"], d["shared_mem"], d["stream"]) == (9, 2, 4096, 0x5353)
    assert ex.bpf_spec().blob_arg == 0


def test_bad_spec_is_a_clear_error(tmp_path):
    bad = tmp_path / "p.toml"
    bad.write_text('[[probe]]\nlibrary = "x"\nsymbol = "f"\nkind = "launch"\nargs = ["a:nosuchtype"]\n')
    with pytest.raises(InputError, match="unknown type"):
        load_specs(bad)


def test_op_name_parser():
    assert op_name_from_mangled("_ZN2at4_ops5addmm4callERKNS_6TensorES4_S4_RKN3c106ScalarES8_") == "aten::addmm"
    assert op_name_from_mangled("_ZN2at4_ops10add_Tensor4callERKNS_6TensorES4_RKN3c106ScalarE") == "aten::add_Tensor"
    assert op_name_from_mangled("_ZN2at4_ops5addmm10redispatchEN3c1014DispatchKeySetE") is None
    assert op_name_from_mangled("_ZN2at6native5addmmE") is None


def test_elf_offsets_match_nm(tmp_path):
    cc, nm = shutil.which("cc") or shutil.which("gcc"), shutil.which("nm")
    if not cc or not nm:
        pytest.skip("needs cc and nm")
    from tests.bpf.conftest import FAKES
    lib = tmp_path / "libcuda.so.1"
    subprocess.run([cc, "-shared", "-fPIC", "-O1", "-o", str(lib), str(FAKES / "fake_cuda.c")], check=True)
    nm_out = subprocess.run([nm, "-D", "--defined-only", str(lib)], capture_output=True, text=True).stdout
    want = {line.split()[2]: int(line.split()[0], 16) for line in nm_out.splitlines() if " T " in line}
    with ElfFile(str(lib)) as elf:
        offs = elf.symbol_offsets(list(want))
        table = SymbolTable(elf)
        for name, vaddr in want.items():
            assert elf.vaddr_to_offset(vaddr) == offs[name]
            assert table.lookup(vaddr) == name and table.lookup(vaddr + 1) == name


def test_not_elf_is_input_error(tmp_path):
    p = tmp_path / "x.so"
    p.write_bytes(b"not an elf file at all, really not" * 4)
    with pytest.raises(InputError):
        ElfFile(str(p))


def test_source_parameters_are_cflags_not_patches():
    src = build_source(gpu=True, ops=True, cpu=True, ringbuf_pages=2048)
    assert "-DSL_RINGBUF_PAGES=2048" in src.cflags and "2048" not in src.text
    assert src.render().startswith("/* stacklens BPF program; compiled with cflags: -DSL_MAX_TARGETS=")
    assert not any("TGID" in f for f in src.cflags)   # one program serves every target
    assert "sl_api_entry_multi" in src.text and "sl_op_entry_multi" in src.text and "sl_cpu_sample" in src.text
    assert "#ifdef STACKLENS_PYSTACK" in src.text  # the Python-stack hook point
    assert SlEvent.py_stack_id.offset > 0
