"""CUPTI copy and memset records (CUpti_ActivityMemcpy6 / CUpti_ActivityMemset4) from the header
to the daemon's records: the ctypes mirrors (tests/fakes/cupti_records.py) against the installed
cupti_activity.h, then the agent's layout taken from record dtypes, raw buffers of such records
parsed by inject/channel/gpu/cupti.py (direction, memory kinds, graph ids, in-flight records)."""

from __future__ import annotations

import ctypes as ct
import glob
import os
import shutil
import subprocess

import pytest

from stacklens.inject.channel.gpu import cupti as cr
from stacklens.inject.agent import wire
from stacklens.records.agent import KernelRecord, MemcpyRecord
from tests.fakes import cupti_records as cu
from tests.unit.test_agent_cupti_raw import KERNEL, RawCupti, kernel, make
from tests.unit.test_agent_cupti import ActivityKind

HEADERS = sorted(glob.glob("/usr/local/cuda*/include/cupti_activity.h")) + (
    [os.path.join(os.environ["CUDA_HOME"], "include", "cupti_activity.h")] if os.environ.get("CUDA_HOME") else [])


def _header():
    for h in HEADERS:
        if os.path.exists(h):
            return h
    return None


def test_mirrors_match_the_installed_cupti_header(tmp_path):
    """sizeof and every field's offsetof, compiled against cupti_activity.h (LP64, GCC)."""
    h = _header()
    cc = shutil.which("cc") or shutil.which("gcc")
    if h is None or cc is None:
        pytest.skip("no cupti_activity.h (CUDA toolkit) or no C compiler here")
    lines = ["#include <stdio.h>", "#include <stddef.h>", "#include <cupti_activity.h>", "int main(void) {"]
    for cname, s in cu.MIRRORS.items():
        lines.append(f'printf("{cname} sizeof %zu\\n", sizeof({cname}));')
        for f, _ in s._fields_:
            lines.append(f'printf("{cname} {f} %zu\\n", offsetof({cname}, {f}));')
    lines.append("return 0; }")
    src = tmp_path / "layouts.c"
    src.write_text("\n".join(lines))
    inc = os.path.dirname(h)
    exe = tmp_path / "layouts"
    subprocess.run([cc, "-I", inc, "-o", str(exe), str(src)], check=True, capture_output=True)
    got = {}
    for line in subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout.splitlines():
        cname, field, value = line.split()
        got[(cname, field)] = int(value)
    for cname, s in cu.MIRRORS.items():
        assert got[(cname, "sizeof")] == ct.sizeof(s), cname
        for f, _ in s._fields_:
            assert got[(cname, f)] == getattr(s, f).offset, (cname, f)


def test_mirror_sizes_without_the_header():
    # the header's PACKED_ALIGNMENT rounds to 8; these are what the check above found for CUDA 13.0
    assert ct.sizeof(cu.ActivityMemcpy6) == 96 and ct.sizeof(cu.ActivityMemset4) == 88
    assert cu.ActivityMemcpy6.correlationId.offset == 44 and cu.ActivityMemcpy6.graphId.offset == 72
    assert cu.ActivityMemset4.correlationId.offset == 44 and cu.ActivityMemset4.memoryKind.offset == 50


class HeaderCupti(RawCupti):
    """cupti-python's surface with record dtypes as the header lays them out."""
    activity_memcpy6_dtype = cu.dtype(cu.ActivityMemcpy6)
    activity_memset4_dtype = cu.dtype(cu.ActivityMemset4)
    ActivityMemcpyKind = cu.ActivityMemcpyKind
    ActivityMemoryKind = cu.ActivityMemoryKind


def _collector_layout():
    from stacklens.inject.agent.gpu.cupti import CuptiCollector
    from tests.unit.test_agent_cupti import fake_gpu

    c = CuptiCollector(lambda *a: None, lib=HeaderCupti(), gpu=fake_gpu())
    return c._layout()


def test_agent_layout_from_header_dtypes():
    lay = _collector_layout()
    mc = lay["kinds"][str(int(ActivityKind.MEMCPY))]
    ms = lay["kinds"][str(int(ActivityKind.MEMSET))]
    assert mc["size"] == 96 and ms["size"] == 88
    assert mc["fields"]["copy_kind"] == [4, "B"] and mc["fields"]["src_kind"] == [5, "B"]
    assert mc["fields"]["dst_kind"] == [6, "B"] and mc["fields"]["bytes"] == [8, "Q"]
    assert mc["fields"]["correlation_id"] == [44, "I"] and mc["fields"]["graph_id"] == [72, "I"]
    assert ms["fields"]["memory_kind"] == [50, "H"] and ms["fields"]["graph_id"] == [72, "I"]
    assert ms["fields"]["correlation_id"] == [44, "I"] and ms["fields"]["stream_id"] == [40, "I"]
    assert lay["copy_kinds"] == {"1": "HtoD", "2": "DtoH", "8": "DtoD", "9": "HtoH", "10": "PtoP"}
    assert lay["memory_kinds"]["1"] == "Pageable" and lay["memory_kinds"]["6"] == "Device Static"
    assert set(lay["memory_kinds"].values()) == set(wire.RAW_MEMORY_KINDS)


def _pack(recs, align=8):
    out = bytearray()
    for r in recs:
        out += r + b"\0" * (-len(r) % align)
    return bytes(out)


def _parse(recs, mode="sizes"):
    layout = cr.parse_layout(_collector_layout())
    body = _pack(recs)
    head = {"t": "cupti_raw", "off_ns": 1000, "mode": "sizes", "n_offs": 0, "align": 8}
    if mode == "offsets":
        offs, o = [], 0
        for r in recs:
            offs.append(o)
            o += len(r) + (-len(r) % 8)
        import struct
        head.update(mode="offsets", n_offs=len(offs))
        body = struct.pack(f"<{len(offs)}I", *offs) + body
    names = cr.NameReader(os.getpid())
    try:
        return cr.parse_raw(head, body, layout, names)
    finally:
        names.close()


KERNEL_NAME = ct.create_string_buffer(b"void fill_kernel(int)")


def _kernel(corr, s, e):
    return kernel(corr, s, e, name_ptr=ct.addressof(KERNEL_NAME))


@pytest.mark.parametrize("mode", ["sizes", "offsets"])
def test_copies_and_memsets_in_a_mixed_buffer(mode):
    M, P = cu.ActivityMemoryKind, cu.ActivityMemcpyKind
    recs = [cu.memcpy6(5, P.HTOD, 4096, 100, 300, src=M.PAGEABLE, dst=M.DEVICE),
            _kernel(6, 400, 900),
            cu.memcpy6(7, P.DTOH, 1 << 20, 1000, 5000, src=M.DEVICE, dst=M.PINNED),
            cu.memset4(8, 256, 6000, 6100, memory=M.DEVICE),
            cu.memset4(9, 64, 7000, 7001, memory=M.DEVICE, graph_id=3),
            cu.memcpy6(10, P.ATOH, 8, 8000, 8010, src=M.ARRAY, dst=99),       # odd kinds: "other", Unknown
            cu.memcpy6(11, P.DTOD, 32, 9000, 0)]                              # in flight: end 0
    got, counters = _parse(recs, mode)
    assert got == [
        MemcpyRecord("HtoD", 4096, 1100, 1300, 0, 7, 5, "Pageable -> Device", 0),
        KernelRecord("void fill_kernel(int)", 1400, 1900, 0, 7, 6, (1, 2, 3), (4, 5, 6), 0),
        MemcpyRecord("DtoH", 1 << 20, 2000, 6000, 0, 7, 7, "Device -> Pinned", 0),
        MemcpyRecord("memset", 256, 7000, 7100, 0, 7, 8, "Device", 0),
        MemcpyRecord("memset", 64, 8000, 8001, 0, 7, 9, "Device", 3),
        MemcpyRecord("other", 8, 9000, 9010, 0, 7, 10, "Array -> Unknown", 0),
    ]
    assert counters["raw_incomplete"] == 1 and counters["raw_bad_record"] == 0


def test_layout_without_memory_kind_names_gives_no_memory():
    lay = _collector_layout()
    del lay["memory_kinds"]
    layout = cr.parse_layout(lay)
    head = {"t": "cupti_raw", "off_ns": 0, "mode": "sizes", "n_offs": 0, "align": 8}
    names = cr.NameReader(os.getpid())
    try:
        got, _ = cr.parse_raw(head, _pack([cu.memcpy6(1, 1, 8, 1, 2), cu.memset4(2, 8, 3, 4)]), layout, names)
    finally:
        names.close()
    assert [r.memory for r in got] == ["", ""]


def test_layout_without_the_optional_copy_fields_still_parses():
    lay = _collector_layout()
    for k in (str(int(ActivityKind.MEMCPY)), str(int(ActivityKind.MEMSET))):
        for f in ("src_kind", "dst_kind", "memory_kind", "graph_id"):
            lay["kinds"][k]["fields"].pop(f, None)
    layout = cr.parse_layout(lay)
    head = {"t": "cupti_raw", "off_ns": 0, "mode": "sizes", "n_offs": 0, "align": 8}
    names = cr.NameReader(os.getpid())
    try:
        got, _ = cr.parse_raw(head, _pack([cu.memcpy6(1, 2, 8, 1, 2, graph_id=5), cu.memset4(2, 8, 3, 4)]),
                              layout, names)
    finally:
        names.close()
    assert got == [MemcpyRecord("DtoH", 8, 1, 2, 0, 7, 1), MemcpyRecord("memset", 8, 3, 4, 0, 7, 2)]


@pytest.mark.parametrize("bad", [{"1": "Pinned memory"}, {"1": 3}, {"x": "Pinned"}, {"1": ["Device"]}])
def test_hostile_memory_kinds_are_refused(bad):
    lay = _collector_layout()
    lay["memory_kinds"] = bad
    with pytest.raises(cr.ProtocolError):
        cr.parse_layout(lay)


def test_collector_enables_copy_and_memset_activity_with_the_kernels():
    c, lib, notes, sunk, cb = make()
    K = lib.ActivityKind
    assert {K.CONCURRENT_KERNEL, K.MEMCPY, K.MEMSET} <= set(c.enabled_kinds)
    lay = next(r for k, r in sunk if k == "cupti_layout")
    assert {lay["kinds"][str(int(K.MEMCPY))]["rec"], lay["kinds"][str(int(K.MEMSET))]["rec"]} == {"memcpy", "memset"}


def test_api_records_kept_for_copies_and_memsets_not_for_graph_building():
    from stacklens.inject.agent.gpu.cupti import CuptiCollector
    from tests.unit.test_agent_cupti import CallbackDomain, FakeCupti, fake_gpu

    names = {1: "cuLaunchKernel", 2: "cuMemcpyAsync", 3: "cuMemsetD32Async", 4: "cuCtxGetCurrent",
             5: "cuGraphAddMemcpyNode", 6: "cudaMemcpyAsync_v3020", 7: "cudaGraphAddMemsetNode_v10000"}

    class Lib(FakeCupti):
        def get_callback_name(self, domain, cbid):
            if cbid not in names:
                raise KeyError(cbid)
            return names[cbid]

    lib = Lib()
    enabled = {}
    lib.activity_enable_driver_api = lambda cbid, on: enabled.__setitem__(("d", cbid), on)
    lib.activity_enable_runtime_api = lambda cbid, on: enabled.__setitem__(("r", cbid), on)
    c = CuptiCollector(lambda *a: None, lib=lib, gpu=fake_gpu())
    c._restrict_api_records()
    on = {names[cb] for (d, cb), v in enabled.items() if v and d == "d"}
    assert on == {"cuLaunchKernel", "cuMemcpyAsync", "cuMemsetD32Async", "cudaMemcpyAsync_v3020"}
    assert CallbackDomain.DRIVER_API == 1
