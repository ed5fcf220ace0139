"""Raw CUPTI buffers on the daemon side (inject/channel/gpu/cupti.py, AgentServer): strict layout and header
validation, both walk modes, kernel names read from real /proc/PID/mem, hostile input."""

import copy
import ctypes
import json
import os
import socket
import struct

import pytest

from stacklens.inject.channel.gpu import cupti as cr
from stacklens.inject.agent import wire
from tests.agent_in_process import wait
from stacklens.records.agent import KernelRecord, MemcpyRecord
from stacklens.inject.channel.server import AgentServer
from stacklens.inject.channel.validate import MAX_STR, ProtocolError

K_KERNEL, K_MEMCPY, K_MEMSET = 10, 1, 2
KERNEL_SIZE, MEMCPY_SIZE, MEMSET_SIZE = 200, 64, 56
KERNEL_FIELDS = {"kind": [0, "I"], "start": [8, "Q"], "end": [16, "Q"], "device_id": [112, "I"],
                 "stream_id": [120, "I"], "correlation_id": [116, "I"], "grid_x": [32, "i"], "grid_y": [36, "i"],
                 "grid_z": [40, "i"], "block_x": [44, "i"], "block_y": [48, "i"], "block_z": [52, "i"],
                 "name": [136, "Q"], "graph_id": [168, "I"], "registers_per_thread": [28, "H"]}
MEMCPY_FIELDS = {"kind": [0, "I"], "copy_kind": [4, "B"], "bytes": [8, "Q"], "start": [16, "Q"], "end": [24, "Q"],
                 "device_id": [32, "I"], "stream_id": [40, "I"], "correlation_id": [44, "I"]}
MEMSET_FIELDS = {"kind": [0, "I"], "bytes": [8, "Q"], "start": [16, "Q"], "end": [24, "Q"],
                 "device_id": [32, "I"], "stream_id": [40, "I"], "correlation_id": [36, "I"]}
LAYOUT = {"t": "cupti_layout",
          "kinds": {str(K_KERNEL): {"rec": "kernel", "size": KERNEL_SIZE, "fields": KERNEL_FIELDS},
                    str(K_MEMCPY): {"rec": "memcpy", "size": MEMCPY_SIZE, "fields": MEMCPY_FIELDS},
                    str(K_MEMSET): {"rec": "memset", "size": MEMSET_SIZE, "fields": MEMSET_FIELDS}},
          "copy_kinds": {"1": "HtoD", "2": "DtoH", "8": "DtoD"}}
SIZES = {K_KERNEL: KERNEL_SIZE, K_MEMCPY: MEMCPY_SIZE, K_MEMSET: MEMSET_SIZE}
FIELDS = {K_KERNEL: KERNEL_FIELDS, K_MEMCPY: MEMCPY_FIELDS, K_MEMSET: MEMSET_FIELDS}

# kernel names in our own memory: NameReader(os.getpid()) reads them from /proc/self/mem
NAME_A = ctypes.create_string_buffer(b"void at::native::vectorized_elementwise_kernel<4>(int)")
NAME_B = ctypes.create_string_buffer(b"sm80_xmma_gemm_\xc3\xa9")
PTR_A, PTR_B = ctypes.addressof(NAME_A), ctypes.addressof(NAME_B)


def record(kind, **vals):
    b = bytearray(SIZES[kind])
    vals = {"kind": kind, **vals}
    for f, v in vals.items():
        off, fmt = FIELDS[kind][f]
        struct.pack_into("<" + fmt, b, off, v)
    return bytes(b)


def kernel(corr, start, end, name=PTR_A, **kw):
    v = dict(start=start, end=end, device_id=0, stream_id=7, correlation_id=corr, grid_x=128, grid_y=1, grid_z=1,
             block_x=256, block_y=1, block_z=1, name=name, graph_id=0)
    v.update(kw)
    return record(K_KERNEL, **v)


def memcpy(corr, ck, nbytes, start, end):
    return record(K_MEMCPY, copy_kind=ck, bytes=nbytes, start=start, end=end, device_id=1, stream_id=3,
                  correlation_id=corr)


def memset(corr, nbytes, start, end):
    return record(K_MEMSET, bytes=nbytes, start=start, end=end, device_id=0, stream_id=3, correlation_id=corr)


def pack_sizes(recs, align=8):
    out = bytearray()
    for r in recs:
        out += r
        out += b"\0" * (-len(out) % align)
    return bytes(out)


def pack_offsets(recs, gap=8):
    buf, offs = bytearray(), []
    for r in recs:
        offs.append(len(buf))
        buf += r + b"\xee" * gap
    return struct.pack(f"<{len(offs)}I", *offs) + bytes(buf), len(offs)


def hdr(mode="sizes", n_offs=0, off_ns=0, align=8):
    return {"t": "cupti_raw", "off_ns": off_ns, "mode": mode, "n_offs": n_offs, "align": align}


@pytest.fixture
def names():
    nr = cr.NameReader(os.getpid())
    yield nr
    nr.close()


@pytest.fixture
def layout():
    return cr.parse_layout(LAYOUT)


MIXED = [kernel(1, 1000, 1500), memcpy(2, 1, 4096, 1600, 1700), kernel(3, 2000, 2600, name=PTR_B, graph_id=9),
         memset(4, 512, 2700, 2650), memcpy(5, 77, 8, 3000, 3100)]
OFF = 1_000_000


def expected(off):
    return [KernelRecord(NAME_A.value.decode(), 1000 + off, 1500 + off, 0, 7, 1, (128, 1, 1), (256, 1, 1), 0),
            MemcpyRecord("HtoD", 4096, 1600 + off, 1700 + off, 1, 3, 2),
            KernelRecord("sm80_xmma_gemm_é", 2000 + off, 2600 + off, 0, 7, 3, (128, 1, 1), (256, 1, 1), 9),
            MemcpyRecord("memset", 512, 2700 + off, 2700 + off, 0, 3, 4),      # end < start: end = start
            MemcpyRecord("other", 8, 3000 + off, 3100 + off, 1, 3, 5)]         # unknown copy kind code


def test_sizes_mode_exact_records_with_clock_offset(layout, names):
    recs, c = cr.parse_raw(hdr(off_ns=OFF), pack_sizes(MIXED), layout, names)
    assert recs == expected(OFF)
    assert c["raw_records"] == 5 and c["raw_incomplete"] == c["raw_unknown_kind"] == c["raw_bad_record"] == 0
    assert c["raw_unresolved_names"] == 0


def test_offsets_mode_exact_records(layout, names):
    body, n = pack_offsets(MIXED)
    recs, c = cr.parse_raw(hdr("offsets", n, off_ns=-500), body, layout, names)
    assert recs == expected(-500)
    # a negative clock offset never gives negative times
    recs, _ = cr.parse_raw(hdr("offsets", n, off_ns=-10_000), body, layout, names)
    assert all(r.start_ns == 0 and r.end_ns == 0 for r in recs)


def test_in_flight_kernels_are_skipped_and_counted(layout, names):
    recs, c = cr.parse_raw(hdr(), pack_sizes([kernel(1, 100, 0), kernel(2, 100, 50), kernel(3, 100, 200)]),
                           layout, names)
    assert [r.correlation_id for r in recs] == [3] and c["raw_incomplete"] == 2


def test_out_of_range_values_skip_one_record(layout, names):
    recs, c = cr.parse_raw(hdr(), pack_sizes([kernel(1, 1, 2, device_id=70000), kernel(2, 1, 2, grid_x=-1),
                                              kernel(3, 1, 2 ** 64 - 1), kernel(4, 1, 2)]), layout, names)
    assert [r.correlation_id for r in recs] == [4] and c["raw_bad_record"] == 3


def test_unknown_kind(layout, names):
    junk = struct.pack("<I", 99) + b"\0" * 60
    # sizes: the walk cannot know how big it is, so it stops there
    recs, c = cr.parse_raw(hdr(), pack_sizes([kernel(1, 1, 2), junk, kernel(2, 1, 2)]), layout, names)
    assert [r.correlation_id for r in recs] == [1] and c["raw_unknown_kind"] == 1
    # offsets: skipped, the walk goes on
    body, n = pack_offsets([kernel(1, 1, 2), junk, kernel(2, 1, 2)])
    recs, c = cr.parse_raw(hdr("offsets", n), body, layout, names)
    assert [r.correlation_id for r in recs] == [1, 2] and c["raw_unknown_kind"] == 1


def test_sizes_mode_alignment(names):
    lay = copy.deepcopy(LAYOUT)
    lay["kinds"][str(K_MEMSET)]["size"] = 44          # not a multiple of 16: the next record at 48
    recs_in = [memset(1, 8, 1, 2)[:44], memset(2, 8, 3, 4)[:44], kernel(3, 5, 6)]
    body = pack_sizes(recs_in, 16)
    assert len(body) == 48 + 48 + 208
    recs, c = cr.parse_raw(hdr(align=16), body, cr.parse_layout(lay), names)
    assert [r.correlation_id for r in recs] == [1, 2, 3]


def test_graph_id_optional_and_overlapping_fields(names):
    lay = copy.deepcopy(LAYOUT)
    del lay["kinds"][str(K_KERNEL)]["fields"]["graph_id"]
    lay["kinds"][str(K_KERNEL)]["fields"]["stream_lo"] = [120, "H"]   # overlaps stream_id: still fine
    recs, _ = cr.parse_raw(hdr(), pack_sizes([kernel(1, 1, 2, graph_id=5)]), cr.parse_layout(lay), names)
    assert recs[0].graph_id == 0 and recs[0].stream == 7 and recs[0].name == NAME_A.value.decode()


def test_name_reader_real_memory_and_failures():
    nr = cr.NameReader(os.getpid(), max_entries=3)
    try:
        assert nr.get(PTR_A) == NAME_A.value.decode() and nr.unresolved == 0
        assert nr.get(PTR_A + 5) == NAME_A.value[5:].decode()
        assert nr.get(0) == "unresolved:0x0" and nr.unresolved == 1
        assert nr.get(0x10) == "unresolved:0x10"                   # unmapped page
        assert nr.get(2 ** 64 - 8) == f"unresolved:0x{2 ** 64 - 8:x}"
        assert len(nr.cache) <= 3                                 # bounded: cleared when full
        assert nr.get(0) == "unresolved:0x0"
        # long names are cut at MAX_STR; a name across pages is read whole
        long = ctypes.create_string_buffer(b"x" * 3 * MAX_STR)
        assert nr.get(ctypes.addressof(long)) == "x" * MAX_STR
        page = 4096
        big = ctypes.create_string_buffer(3 * page)
        at = (ctypes.addressof(big) // page + 1) * page - 3      # 3 bytes before a page boundary
        ctypes.memmove(at, b"abcdefgh\0", 9)
        assert nr.get(at) == "abcdefgh"
        ctypes.memmove(at, b"\xff\xfebad\0", 6)
        assert nr.read(at) == "\ufffd\ufffdbad"
    finally:
        nr.close()
    assert nr.get(PTR_B).startswith("unresolved:")               # closed: nothing read any more
    gone = cr.NameReader(2 ** 22 + 12345)                        # no such process
    assert gone.get(PTR_A) == f"unresolved:0x{PTR_A:x}"
    gone.close()


def test_unresolved_names_counted_in_parse(layout, names):
    recs, c = cr.parse_raw(hdr(), pack_sizes([kernel(1, 1, 2, name=0), kernel(2, 1, 2, name=0), kernel(3, 1, 2)]),
                           layout, names)
    assert [r.name for r in recs] == ["unresolved:0x0", "unresolved:0x0", NAME_A.value.decode()]
    assert c["raw_unresolved_names"] == 1                        # cached after the first


def _bad_layout(path, value):
    lay = copy.deepcopy(LAYOUT)
    d = lay
    for p in path[:-1]:
        d = d[p]
    if value is KeyError:
        del d[path[-1]]
    else:
        d[path[-1]] = value
    return lay


KF = ("kinds", "10", "fields")


@pytest.mark.parametrize("lay", [
    None, [], {"t": "cupti_layout"}, {"t": "other", "kinds": LAYOUT["kinds"]},
    _bad_layout(("kinds",), {}),
    _bad_layout(("kinds",), {str(i): LAYOUT["kinds"]["10"] for i in range(17)}),
    _bad_layout(("kinds",), {"1001": LAYOUT["kinds"]["10"]}),
    _bad_layout(("kinds",), {"-1": LAYOUT["kinds"]["10"]}),
    _bad_layout(("kinds",), {"0x10": LAYOUT["kinds"]["10"]}),
    _bad_layout(("kinds", "10", "rec"), "sync"),
    _bad_layout(("kinds", "10", "size"), 4),
    _bad_layout(("kinds", "10", "size"), 4097),
    _bad_layout(("kinds", "10", "size"), 100.0),
    _bad_layout(("kinds", "10", "size"), 150),                      # name/graph_id beyond the size
    _bad_layout(KF + ("name",), [136, "d"]),                       # not an allowed format
    _bad_layout(KF + ("name",), [136, "QQ"]),
    _bad_layout(KF + ("name",), [196, "Q"]),                       # field beyond the record
    _bad_layout(KF + ("name",), [-8, "Q"]),
    _bad_layout(KF + ("name",), [True, "Q"]),
    _bad_layout(KF + ("name",), [136]),
    _bad_layout(KF + ("name",), KeyError),                          # required field missing
    _bad_layout(KF + ("kind",), [4, "I"]),                          # the kind must be at offset 0
    _bad_layout(KF, {**KERNEL_FIELDS, **{f"x{i}": [0, "B"] for i in range(30)}}),   # > 40 fields
    _bad_layout(("kinds", "1", "fields", "copy_kind"), KeyError),
    _bad_layout(("copy_kinds",), {"1": "sideways"}),
    _bad_layout(("copy_kinds",), {"x": "HtoD"}),
    _bad_layout(("copy_kinds",), []),
])
def test_bad_layouts(lay):
    with pytest.raises(ProtocolError):
        cr.parse_layout(lay)


@pytest.mark.parametrize("h", [
    None, {}, hdr() | {"t": "kernel"}, hdr() | {"off_ns": 2 ** 63}, hdr() | {"off_ns": 1.5},
    hdr() | {"mode": "both"}, hdr("offsets", -1), hdr("offsets", 200_001), hdr("sizes", 1), hdr(align=3),
    hdr(align=True), hdr("offsets", True),
])
def test_bad_headers(h, layout, names):
    with pytest.raises(ProtocolError):
        cr.parse_raw(h, pack_sizes(MIXED), layout, names)


def test_hostile_buffers(layout, names):
    body, n = pack_offsets(MIXED)
    offs_len = 4 * n
    bad = [
        (hdr("offsets", n), body[:offs_len - 2]),                          # shorter than its offsets
        (hdr("offsets", 200_000), body),                                    # huge n_offs, short body
        (hdr("offsets", n), body[:-20]),                                    # last record truncated
        (hdr("offsets", 2), struct.pack("<2I", 0, 0) + body[offs_len:]),    # not increasing
        (hdr("offsets", 2), struct.pack("<2I", 200, 0) + body[offs_len:]),
        (hdr("offsets", 1), struct.pack("<I", 2 ** 32 - 1) + body[offs_len:]),   # out of the buffer
        (hdr(), pack_sizes(MIXED)[:-30]),                                   # sizes: truncated record
    ]
    for h, b in bad:
        with pytest.raises(ProtocolError):
            cr.parse_raw(h, b, layout, names)
    # harmless cases: empty buffer, a tail shorter than a kind, only padding
    assert cr.parse_raw(hdr(), b"", layout, names)[0] == []
    assert cr.parse_raw(hdr(), b"\0\0", layout, names)[0] == []
    recs, c = cr.parse_raw(hdr(), b"\0" * 64, layout, names)
    assert recs == [] and c["raw_unknown_kind"] == 1
    with pytest.raises(ProtocolError):
        cr.parse_raw(hdr(), b"", None, names)


def test_random_garbage_never_crashes(layout, names):
    import random
    rnd = random.Random(7)
    good = pack_sizes(MIXED)
    for _ in range(300):
        b = bytearray(good)
        for _ in range(rnd.randrange(1, 20)):
            b[rnd.randrange(len(b))] = rnd.randrange(256)
        for mode in ("sizes", "offsets"):
            n = rnd.randrange(0, 8) if mode == "offsets" else 0
            try:
                recs, c = cr.parse_raw(hdr(mode, n), bytes(b), layout, names)
            except ProtocolError:
                continue
            for r in recs:
                assert 0 <= r.start_ns <= r.end_ns < 2 ** 63 and 0 <= r.device <= 1 << 16


# -- end to end through a real AgentServer socket ---------------------------------------------

def _connect(srv):
    c = socket.socket(socket.AF_UNIX)
    c.connect(srv.path)
    c.sendall(wire.encode({"t": "hello", "v": wire.VERSION, "token": srv.token, "pid": os.getpid(),
                           "tid": 1, "python": [3, 11, 0], "executable": "python"}))
    return c


def test_end_to_end_through_the_agent_server(tmp_path):
    srv = AgentServer(os.getpid(), tmp_path / "agents")
    try:
        c = _connect(srv)
        body, n = pack_offsets(MIXED)
        # a raw frame before the layout is rejected and counted
        c.sendall(wire.encode_raw(hdr("offsets", n, off_ns=OFF), body))
        c.sendall(wire.encode(LAYOUT))
        c.sendall(wire.encode_raw(hdr("offsets", n, off_ns=OFF), body[:offs_len(n)], body[offs_len(n):]))
        c.sendall(wire.encode_raw(hdr(off_ns=OFF), pack_sizes([kernel(9, 10, 0), kernel(10, 10, 20, name=0)])))
        c.sendall(wire.encode_raw(hdr(align=5), b""))                       # bad header: rejected
        # a full-size 1 MiB buffer in one frame (bigger than a JSON frame may be)
        many = [kernel(100 + i, 10 * i + 1, 10 * i + 5) for i in range((1 << 20) // KERNEL_SIZE)]
        c.sendall(wire.encode_raw(hdr(), pack_sizes(many)))
        c.sendall(wire.encode({"t": "note", "level": "info", "msg": "after", "t_ns": 1}))
        assert wait(lambda: srv.stats().get("records", 0) >= 1 + 5 + 1 + len(many) + 1)
        recs = srv.poll()[1:]                                               # [0] is the hello
        assert recs[:5] == expected(OFF)
        assert recs[5] == KernelRecord("unresolved:0x0", 10 + OFF, 20 + OFF, 0, 7, 10, (128, 1, 1), (256, 1, 1), 0)
        assert [r.correlation_id for r in recs[6:-1]] == [100 + i for i in range(len(many))]
        assert recs[-1].message == "after"
        st = srv.stats()
        assert st["cupti_layouts"] == 1 and st["raw_frames"] == 5
        assert st["rejected_message:cupti_raw"] == 2 and st["raw_incomplete"] == 1
        assert st["raw_records"] == 5 + 1 + len(many) and st["raw_unresolved_names"] == 1
        # a bad layout is rejected and keeps the one we have
        c.sendall(wire.encode(_bad_layout(KF + ("name",), [196, "Q"])))
        assert wait(lambda: srv.stats().get("rejected_message:cupti_layout") == 1)
        c.close()
    finally:
        srv.close()
    assert srv._agent.names is not None and srv._agent.names._mem is None


def offs_len(n):
    return 4 * n


def test_oversize_and_pre_hello_raw_frames(tmp_path):
    srv = AgentServer(os.getpid(), tmp_path / "agents")
    try:
        # raw frame before the hello: dropped like any other pre-hello frame
        c = socket.socket(socket.AF_UNIX)
        c.connect(srv.path)
        c.settimeout(2)
        c.sendall(wire.encode_raw(hdr(), b""))
        assert c.recv(10) == b""
        c.close()
        assert wait(lambda: srv.stats().get("rejected_hello") == 1)
        # a JSON frame bigger than MAX_FRAME is oversize even though raw frames may be that big
        for payload in (b"{" + b" " * wire.MAX_FRAME, wire.RAW_MAGIC + b"\0" * wire.MAX_RAW_FRAME):
            c = _connect(srv)
            c.sendall(struct.pack(">I", len(payload)) + payload[:16])
            c.settimeout(2)
            try:
                while c.recv(1 << 16):
                    pass
            except OSError:
                pass
            c.close()
        assert wait(lambda: srv.stats().get("rejected_oversize") == 2)
    finally:
        srv.close()


def test_one_protocol_error_and_the_raw_kinds_are_known():
    from stacklens.inject.channel import messages
    assert messages.ProtocolError is cr.ProtocolError and messages.MAX_STR == cr.MAX_STR
    assert "cupti_layout" in messages.KNOWN_KINDS and "cupti_raw" in messages.KNOWN_KINDS
    json.dumps(LAYOUT)


def _recv_msgs(c, want, timeout=5.0):
    """JSON messages the server sent back until `want` of them arrived."""
    c.settimeout(timeout)
    buf, out = b"", []
    while len(out) < want:
        data = c.recv(1 << 16)
        if not data:
            break
        buf += data
        msgs, used = wire.decode_all(buf)
        out += msgs
        buf = buf[used:]
    return out


def test_buffers_left_in_place_are_read_from_target_memory_and_freed(tmp_path):
    """cupti_ref: the agent sends an address and a length, the server reads the buffer through
    /proc/PID/mem (here our own memory), parses it like a raw frame, and sends "free" back —
    also for a reference it could not read or parse, so the agent never leaks a buffer. A bad
    address or length is rejected and counted; the connection stays up."""
    import ctypes

    srv = AgentServer(os.getpid(), tmp_path / "agents")
    try:
        c = _connect(srv)
        assert _recv_msgs(c, 1)[0]["t"] == "config"
        data = pack_sizes([kernel(7, 10, 20), kernel(8, 30, 40)])
        buf = ctypes.create_string_buffer(data, len(data))
        addr = ctypes.addressof(buf)
        c.sendall(wire.encode({"t": "cupti_ref", "h": hdr(off_ns=OFF), "a": addr, "n": len(data)}))  # no layout yet
        c.sendall(wire.encode(LAYOUT))
        c.sendall(wire.encode({"t": "cupti_ref", "h": hdr(off_ns=OFF), "a": addr, "n": len(data)}))
        c.sendall(wire.encode({"t": "cupti_ref", "h": hdr(), "a": 8, "n": 64}))           # unmapped
        c.sendall(wire.encode({"t": "cupti_ref", "h": hdr(), "a": addr, "n": 1 << 30}))   # too long
        c.sendall(wire.encode({"t": "cupti_ref", "h": hdr(), "a": "x", "n": 8}))
        c.sendall(wire.encode({"t": "note", "level": "info", "msg": "after", "t_ns": 1}))
        assert wait(lambda: srv.stats().get("records", 0) >= 1 + 2 + 1)
        recs = srv.poll()[1:]
        assert [r.correlation_id for r in recs[:2]] == [7, 8]
        assert recs[0].start_ns == 10 + OFF and recs[1].end_ns == 40 + OFF and recs[-1].message == "after"
        freed = [a for m in _recv_msgs(c, 1) if m["t"] == "free" for a in m["a"]]
        while len(freed) < 4:
            more = _recv_msgs(c, 1, timeout=2.0)
            assert more, freed
            freed += [a for m in more if m["t"] == "free" for a in m["a"]]
        # every reference with a valid address comes back, also unparsed or too long ones
        assert sorted(freed) == sorted([addr, addr, 8, addr])
        st = srv.stats()
        assert st["ref_frames"] == 5 and st["ref_unreadable"] == 1
        assert st["rejected_message:cupti_ref"] == 4 and st["raw_records"] == 2
        c.close()
    finally:
        srv.close()


def test_agents_copy_buffers_when_the_daemon_cannot_read_target_memory(tmp_path, monkeypatch):
    """Without access to /proc/PID/mem buffers left in place would be lost (read as unreadable):
    the hello's config then turns them off, and the agent sends copies."""
    srv = AgentServer(os.getpid(), tmp_path / "agents")
    try:
        c = _connect(srv)
        cfg = _recv_msgs(c, 1)[0]
        assert cfg["t"] == "config" and cfg.get("gpu_ref", True) is True     # readable here
        c.close()
        monkeypatch.setattr(cr.NameReader, "readable", lambda self: False)
        assert wait(lambda: not srv.connected)
        c = _connect(srv)
        cfg = _recv_msgs(c, 1)[0]
        assert cfg["t"] == "config" and cfg["gpu_ref"] is False
        assert srv.stats()["target_memory_unreadable"] == 1
        c.close()
    finally:
        srv.close()
