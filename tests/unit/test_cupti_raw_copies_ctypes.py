"""Copy and memset records through the agent's real ctypes CUPTI callbacks (fake libcupti from
tests/fakes/fake_cupti.c, completion on a native thread) and the daemon's parser: a buffer that
mixes kernels, CUpti_ActivityMemcpy6 and CUpti_ActivityMemset4 records is walked by
cuptiActivityGetNextRecord, verified against the layout's size walk, shipped, and parsed back into
the same records (the join of such records: tests/unit/test_join_copies.py)."""

from __future__ import annotations

import ctypes
import os

from stacklens.inject.channel.gpu import cupti as cr
from stacklens.inject.agent.gpu import cupti as cupti_mod
from stacklens.inject.agent.gpu import cupti_raw
from stacklens.records.agent import KernelRecord, MemcpyRecord
from tests.fakes import cupti_records as cu
from tests.unit.test_agent_cupti import ActivityKind
from tests.unit.test_agent_cupti_raw import KERNEL, kernel
from tests.unit.test_cupti_copy_layouts import _collector_layout
from tests.unit.test_cupti_raw_ctypes import libcupti, stage  # noqa: F401 - the fixture

NAME = ctypes.create_string_buffer(b"void zero_kernel(float*)")


def _pack(recs):
    out = bytearray()
    for r in recs:
        out += r + b"\0" * (-len(r) % 8)
    return bytes(out)


def test_mixed_buffer_walked_verified_and_parsed(libcupti):  # noqa: F811 - the fixture
    layout_msg = _collector_layout()
    sizes = {int(k): v["size"] for k, v in layout_msg["kinds"].items()}
    M, P = cu.ActivityMemoryKind, cu.ActivityMemcpyKind
    recs = [kernel(1, 100, 200, name_ptr=ctypes.addressof(NAME)),
            cu.memcpy6(2, P.HTOD, 1 << 16, 300, 900, src=M.PINNED, dst=M.DEVICE),
            cu.memset4(3, 4096, 1000, 1100, memory=M.DEVICE),
            cu.memcpy6(4, P.DTOH, 4, 1200, 1300, src=M.DEVICE, dst=M.PAGEABLE)]
    data = _pack(recs)
    lib = stage(libcupti, data, int(ActivityKind.CONCURRENT_KERNEL), KERNEL.itemsize)
    lib.fake_cupti_set_size(ctypes.c_uint32(int(ActivityKind.MEMCPY)), ctypes.c_size_t(ctypes.sizeof(cu.ActivityMemcpy6)))
    lib.fake_cupti_set_size(ctypes.c_uint32(int(ActivityKind.MEMSET)), ctypes.c_size_t(ctypes.sizeof(cu.ActivityMemset4)))

    col = cupti_mod.CuptiCollector(lambda *a: None)
    sunk = []
    col.sink = lambda k, r: sunk.append((k, r))
    col.clock = type("C", (), {"offset_ns": 5})()
    col._raw_sizes = sizes
    cb = cupti_raw._ctypes_callbacks(libcupti, col._raw_buffer, col.wants_offsets)
    try:
        cb.flush_all(0)
    finally:
        cb.on_buffer = cb.want_offsets = None
    (kind, (head, body)), = sunk
    assert kind == "raw" and head["mode"] == "offsets" and head["n_offs"] == 4
    assert col._verified == 1                      # CUPTI's walk agreed with the layout's sizes
    names = cr.NameReader(os.getpid())
    try:
        got, counters = cr.parse_raw(head, body, cr.parse_layout(layout_msg), names)
    finally:
        names.close()
    assert got == [KernelRecord("void zero_kernel(float*)", 105, 205, 0, 7, 1, (1, 2, 3), (4, 5, 6), 0),
                   MemcpyRecord("HtoD", 1 << 16, 305, 905, 0, 7, 2, "Pinned -> Device"),
                   MemcpyRecord("memset", 4096, 1005, 1105, 0, 7, 3, "Device"),
                   MemcpyRecord("DtoH", 4, 1205, 1305, 0, 7, 4, "Device -> Pageable")]
    assert counters["raw_records"] == 4
