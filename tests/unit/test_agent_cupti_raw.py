"""The CUPTI collector's raw-buffer path (default without API records) against fakes of its two
interfaces: cupti-python's surface (record dtypes, enable/disable) and the ctypes buffer callbacks.
The daemon side of the same frames: tests/unit/test_cuptiraw.py and the round trip below."""

import struct

import numpy as np

from stacklens.inject.agent.gpu import cupti_raw
from stacklens.inject.agent.gpu.cupti import CuptiCollector
from tests.unit.test_agent_cupti import ActivityKind, FakeCupti, fake_gpu

KERNEL = np.dtype([("kind", "<u4"), ("cache_config", "u1"), ("shared_memory_config", "u1"),
                   ("registers_per_thread", "<u2"), ("partitioned_global_cache_requested", "<u4"),
                   ("partitioned_global_cache_executed", "<u4"), ("start", "<u8"), ("end", "<u8"),
                   ("completed", "<u8"), ("device_id", "<u4"), ("context_id", "<u4"), ("stream_id", "<u4"),
                   ("grid_x", "<i4"), ("grid_y", "<i4"), ("grid_z", "<i4"), ("block_x", "<i4"),
                   ("block_y", "<i4"), ("block_z", "<i4"), ("static_shared_memory", "<i4"),
                   ("correlation_id", "<u4"), ("pad", "<u4"), ("name", "<u8"), ("graph_id", "<u4"),
                   ("tail", "V20")])
MEMCPY = np.dtype([("kind", "<u4"), ("copy_kind", "u1"), ("src_kind", "u1"), ("dst_kind", "u1"),
                   ("flags", "u1"), ("bytes", "<u8"), ("start", "<u8"), ("end", "<u8"),
                   ("device_id", "<u4"), ("context_id", "<u4"), ("stream_id", "<u4"),
                   ("correlation_id", "<u4"), ("tail", "V12")])
MEMSET = np.dtype([("kind", "<u4"), ("value", "<u4"), ("bytes", "<u8"), ("start", "<u8"), ("end", "<u8"),
                   ("device_id", "<u4"), ("context_id", "<u4"), ("stream_id", "<u4"),
                   ("correlation_id", "<u4")])


class RawCupti(FakeCupti):
    activity_kernel10_dtype = KERNEL
    activity_memcpy6_dtype = MEMCPY
    activity_memset4_dtype = MEMSET

    def activity_register_callbacks(self, req, done):
        raise AssertionError("the raw path registers its own (ctypes) callbacks")


class FakeRawCallbacks:
    """The ctypes callbacks' contract: on_buffer(bytes, offsets or None), offsets only when
    want_offsets() says so; flush_all(flag) hands over what is pending."""

    def __init__(self, on_buffer, want_offsets):
        self.on_buffer, self.want_offsets = on_buffer, want_offsets
        self.pending = []
        self.flushes = []

    def flush_all(self, flag):
        self.flushes.append(flag)
        for buf, offs in self.pending:
            if self.on_buffer is not None:
                self.on_buffer(buf, offs if self.want_offsets() else None)
        self.pending = []


def record(dt, **values):
    a = np.zeros(1, dtype=dt)
    for k, v in values.items():
        a[k] = v
    return a.tobytes()


def buffer(records, align=8, gap=0):
    out, offs = b"", []
    for r in records:
        offs.append(len(out))
        out += r + b"\0" * (((len(r) + align - 1) // align) * align - len(r) + gap)
    return out, offs


def kernel(corr, start, end, name_ptr=0x7F00_0000_1000, grid=(1, 2, 3), block=(4, 5, 6)):
    return record(KERNEL, kind=int(ActivityKind.CONCURRENT_KERNEL), start=start, end=end, device_id=0,
                  stream_id=7, correlation_id=corr, grid_x=grid[0], grid_y=grid[1], grid_z=grid[2],
                  block_x=block[0], block_y=block[1], block_z=block[2], name=name_ptr, graph_id=0)


def make():
    lib, notes, sunk = RawCupti(), [], []
    made = []

    def factory(on_buffer, want_offsets):
        made.append(FakeRawCallbacks(on_buffer, want_offsets))
        return made[-1]

    c = CuptiCollector(lambda lvl, msg: notes.append((lvl, msg)), lib=lib, gpu=fake_gpu(), raw_factory=factory)
    c.api_records = False
    assert c.start(lambda k, r: sunk.append((k, r)))
    return c, lib, notes, sunk, made[0]


def test_layout_first_then_buffers_with_offsets_until_the_size_walk_is_verified():
    c, lib, notes, sunk, raw = make()
    assert any("raw buffers" in m for _, m in notes)
    kind, layout = sunk[0]
    assert kind == "cupti_layout" and layout["t"] == "cupti_layout"
    k = layout["kinds"][str(int(ActivityKind.CONCURRENT_KERNEL))]
    assert k["rec"] == "kernel" and k["size"] == KERNEL.itemsize
    assert k["fields"]["name"] == [KERNEL.fields["name"][1], "Q"]
    assert k["fields"]["grid_x"] == [KERNEL.fields["grid_x"][1], "i"]
    assert layout["kinds"][str(int(ActivityKind.MEMCPY))]["fields"]["copy_kind"] == [4, "B"]
    assert layout["copy_kinds"] == {"1": "HtoD", "2": "DtoH"}
    for i in range(cupti_raw.VERIFY_BUFFERS + 2):
        raw.pending.append(buffer([kernel(i, 100, 200), record(MEMSET, kind=2, bytes=64, start=1, end=2)]))
        c.poll()
        c._next_check_ns = 0
    frames = [r for k, r in sunk if k == "raw"]
    modes = [h["mode"] for h, _ in frames]
    assert modes == ["offsets"] * cupti_raw.VERIFY_BUFFERS + ["sizes"] * 2
    head, body = frames[0]
    data, offs = buffer([kernel(0, 100, 200), record(MEMSET, kind=2, bytes=64, start=1, end=2)])
    assert head["n_offs"] == 2 and body == struct.pack("<2I", *offs) + data
    assert frames[-1][1] == buffer([kernel(4, 100, 200), record(MEMSET, kind=2, bytes=64, start=1, end=2)])[0]
    assert head["off_ns"] == c.clock.offset_ns and head["align"] == 8
    assert c.stats()["raw"] == 1 and c.stats()["raw_sizes_mode"] == 1
    c.stop()
    assert raw.flushes[-1] == 1 and lib.enabled == set()
    assert raw.on_buffer is None          # idle after detach; the trampolines stay alive


def test_a_layout_walk_that_disagrees_keeps_offsets_on_every_buffer():
    c, lib, notes, sunk, raw = make()
    for _ in range(cupti_raw.VERIFY_BUFFERS + 2):   # 8 bytes of padding CUPTI did not tell us about
        raw.pending.append(buffer([kernel(1, 100, 200), kernel(2, 300, 400)], gap=8))
        c.poll()
        c._next_check_ns = 0
    modes = [r[0]["mode"] for k, r in sunk if k == "raw"]
    assert modes == ["offsets"] * (cupti_raw.VERIFY_BUFFERS + 2)
    assert any("not laid out by their sizes" in m for _, m in notes)


def test_without_the_record_dtypes_the_collector_falls_back_to_cupti_python():
    notes, sunk = [], []
    lib = FakeCupti()              # no activity_*_dtype attributes
    c = CuptiCollector(lambda lvl, msg: notes.append((lvl, msg)), lib=lib, gpu=fake_gpu(),
                       raw_factory=lambda *a: (_ for _ in ()).throw(AssertionError("not reached")))
    c.api_records = False
    assert c.start(lambda k, r: sunk.append((k, r)))
    assert lib.callbacks is not None and c.stats()["raw"] == 0
    assert any("raw buffers off" in m for _, m in notes)


def test_agent_queues_raw_buffers_by_bytes_and_sends_the_layout_first():
    import socket

    from stacklens.inject.agent import Agent, wire
    a_sock, b_sock = socket.socketpair()
    try:
        agent = Agent(a_sock, "tok", {"max_raw_bytes": 3000})
        agent.gpu.sink("cupti_layout", {"t": "cupti_layout", "kinds": {}, "copy_kinds": {}})
        head = {"t": "cupti_raw", "off_ns": 0, "mode": "sizes", "n_offs": 0, "align": 8}
        agent.gpu.sink("raw", (head, b"x" * 2000))
        agent.gpu.sink("raw", (head, b"y" * 2000))      # over the byte budget: dropped, counted
        assert agent.gpu.raw_dropped == 1
        agent.gpu.send()
        assert agent.gpu.raw_bytes == 0
        out = bytes(agent.ch.out)
        n = int.from_bytes(out[:4], "big")
        assert out[4:4 + n].startswith(b'{"t":"cupti_layout"')
        rest = out[4 + n:]
        assert rest == wire.encode_raw(head, b"x" * 2000)
    finally:
        a_sock.close()
        b_sock.close()


def test_round_trip_agent_frames_parsed_by_the_daemon_with_names_from_target_memory():
    """What the collector sinks, parsed by the daemon's CUPTI decoder (inject/channel/gpu/cupti.py) exactly as the server does; the
    kernel name pointer points into this process's memory (the daemon reads /proc/PID/mem)."""
    import ctypes
    import os

    from stacklens.inject.channel.gpu.cupti import NameReader, parse_layout, parse_raw
    from stacklens.records.agent import KernelRecord, MemcpyRecord

    name = ctypes.create_string_buffer(b"void gemm_kernel<float>(int)")
    ptr = ctypes.addressof(name)
    c, lib, notes, sunk, raw = make()
    layout = parse_layout(sunk[0][1])
    recs = [kernel(41, 1_000, 3_000, name_ptr=ptr, grid=(8, 1, 1), block=(256, 1, 1)),
            kernel(42, 4_000, 0, name_ptr=ptr),                                # still running
            record(MEMCPY, kind=1, copy_kind=2, bytes=4096, start=10, end=20, device_id=0, stream_id=7,
                   correlation_id=43),
            record(MEMSET, kind=2, bytes=64, start=30, end=31, device_id=0, stream_id=7, correlation_id=44)]
    for _ in range(cupti_raw.VERIFY_BUFFERS + 1):     # offsets mode, then sizes mode
        raw.pending.append(buffer(recs))
        c.poll()
        c._next_check_ns = 0
    names = NameReader(os.getpid())
    try:
        frames = [r for k, r in sunk if k == "raw"]
        assert [h["mode"] for h, _ in frames][-2:] == ["offsets", "sizes"]
        off = c.clock.offset_ns
        for head, body in frames[-2:]:
            got, counters = parse_raw(head, body, layout, names)
            assert got == [
                KernelRecord("void gemm_kernel<float>(int)", 1_000 + off, 3_000 + off, 0, 7, 41, (8, 1, 1),
                             (256, 1, 1), 0),
                MemcpyRecord("DtoH", 4096, 10 + off, 20 + off, 0, 7, 43),
                MemcpyRecord("memset", 64, 30 + off, 31 + off, 0, 7, 44),
            ], counters
    finally:
        names.close()
