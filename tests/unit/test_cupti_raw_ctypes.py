"""The agent's ctypes CUPTI buffer callbacks against a fake libcupti built from C
(tests/fakes/fake_cupti.c): a real trampoline called back from another native thread while the
flushing thread waits in C, the buffer copied out byte for byte, offsets from
cuptiActivityGetNextRecord, one set of trampolines per process reused by the next attach."""

import ctypes
import shutil
import struct
import subprocess
from pathlib import Path

import pytest

from stacklens.inject.agent.gpu import cupti as cupti_mod
from stacklens.inject.agent.gpu import cupti_raw

FAKE = Path(__file__).resolve().parents[1] / "fakes" / "fake_cupti.c"


@pytest.fixture(scope="module")
def libcupti(tmp_path_factory):
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler to build the fake libcupti")
    out = tmp_path_factory.mktemp("fakecupti") / "libcupti.so.13"
    subprocess.run([cc, "-O1", "-fPIC", "-shared", "-pthread", "-o", str(out), str(FAKE)], check=True)
    yield str(out)
    if hasattr(ctypes, cupti_raw._KEEPALIVE):
        delattr(ctypes, cupti_raw._KEEPALIVE)


def stage(path, data, kind, size):
    lib = ctypes.CDLL(path)
    lib.fake_cupti_stage(data, ctypes.c_size_t(len(data)), ctypes.c_uint32(kind), ctypes.c_size_t(size))
    return lib


def records(n, kind=10, size=36):
    out = b""
    for i in range(n):
        r = struct.pack("<II", kind, i) + b"\xab" * (size - 8)
        out += r + b"\0" * ((-len(r)) % 8)
    return out


def test_completed_buffer_comes_back_from_a_native_thread_with_its_offsets(libcupti):
    got = []
    cb = cupti_raw._ctypes_callbacks(libcupti, lambda data, offs: got.append((data, offs)), lambda: True)
    data = records(5)
    fake = stage(libcupti, data, 10, 36)
    cb.flush_all(1)
    assert got == [(data, [0, 40, 80, 120, 160])]
    assert fake.fake_cupti_registrations() >= 1
    assert cb._live == {} and len(cb._free) == 1          # the buffer went back to the pool


def test_no_walk_once_verified_and_a_failing_target_never_raises_into_cupti(libcupti):
    got = []
    cb = cupti_raw._ctypes_callbacks(libcupti, lambda data, offs: got.append((data, offs)), lambda: False)
    data = records(3)
    stage(libcupti, data, 10, 36)
    cb.flush_all(0)
    assert got == [(data, None)]

    def boom(data, offs):
        raise RuntimeError("the collector failed")

    cb2 = cupti_raw._ctypes_callbacks(libcupti, boom, lambda: True)
    assert cb2 is cb                     # one set of trampolines per process, reused
    stage(libcupti, records(2), 10, 36)
    cb.flush_all(1)                      # swallowed: nothing printed, nothing raised
    cb.on_buffer = cb.want_offsets = None
    stage(libcupti, records(2), 10, 36)
    cb.flush_all(1)                      # detached: buffers come back and are dropped
    assert cb._live == {}


def test_verified_buffers_stay_in_place_until_the_daemon_frees_them(libcupti):
    """The zero-copy path: a verified buffer is not copied; its address goes out (on_ref) and the
    daemon's reader (NameReader.read_block, /proc/PID/mem — here our own) sees its bytes; 'free'
    returns it to the pool; beyond max_shipped buffers fall back to the copy path."""
    import os

    from stacklens.inject.channel.gpu.cupti import NameReader

    copied, refs = [], []
    cb = cupti_raw._ctypes_callbacks(libcupti, lambda data, offs: copied.append(data), lambda: False)
    cb.on_ref = lambda addr, valid: refs.append((addr, valid)) or True
    cb.max_shipped = 2
    cb.shipped = {}                  # a session's own dict (the collector hands it over)
    reader = NameReader(os.getpid())
    try:
        datas = [records(4 + i) for i in range(3)]
        for d in datas:
            stage(libcupti, d, 10, 36)
            cb.flush_all(0)
        assert [v for _, v in refs] == [len(datas[0]), len(datas[1])] and copied == [datas[2]]
        assert set(cb.shipped) == {a for a, _ in refs}
        for (addr, valid), d in zip(refs, datas):
            assert reader.read_block(addr, valid) == d      # what the daemon reads, in place
        assert reader.read_block(0, 8) is None and reader.read_block(refs[0][0], 1 << 30) is None
        cb.release([refs[0][0], 12345])                      # an unknown address is ignored
        assert set(cb.shipped) == {refs[1][0]} and len(cb._free) >= 1
        stage(libcupti, datas[0], 10, 36)
        cb.flush_all(0)                                      # room again: in place
        assert len(refs) == 3 and len(copied) == 1
        cb.on_ref = lambda addr, valid: False                # the collector declined: copied
        stage(libcupti, datas[1], 10, 36)
        cb.flush_all(0)
        assert copied[-1] == datas[1] and len(cb.shipped) == 2
        cb.release(list(cb.shipped))
        # the daemon can free a buffer before the completion callback has returned (the agent
        # thread sent the ref while CUPTI's thread waited for the GIL): it must not leak
        cb.on_ref = lambda addr, valid: cb.release([addr]) or True
        stage(libcupti, datas[2], 10, 36)
        cb.flush_all(0)
        assert cb.shipped == {}
    finally:
        reader.close()
        cb.on_ref = None
        cb.on_buffer = cb.want_offsets = None


def test_agent_and_daemon_move_buffers_in_place_end_to_end(libcupti, tmp_path):
    """The agent's collector (ctypes callbacks on the fake libcupti, a native completion thread)
    leaves verified buffers in place; the agent sends their addresses; a real AgentServer reads
    them from this process's memory, parses them, and frees them; the agent's detach wait sees
    none left. No raw frame crosses the socket."""
    import os
    import socket
    import time

    from stacklens.inject.channel.server import AgentServer
    from stacklens.inject.agent import Agent, wire
    from tests.unit.test_cuptiraw import K_KERNEL, KERNEL_SIZE, LAYOUT, OFF, kernel, pack_sizes

    srv = AgentServer(os.getpid(), tmp_path / "agents")
    sock = socket.socket(socket.AF_UNIX)
    sock.connect(srv.path)
    agent = Agent(sock, srv.token)
    col = cupti_mod.CuptiCollector(lambda *a: None)
    try:
        agent.ch.send({"t": "hello", "v": wire.VERSION, "token": srv.token, "pid": os.getpid(), "tid": 1,
                       "python": [3, 11, 0], "executable": "python"})
        end = time.monotonic() + 5
        while not any(m.get("t") == "config" for m in agent.ch.pump(0.05)) and time.monotonic() < end:
            pass
        col.sink = agent.gpu.sink
        col.clock = type("C", (), {"offset_ns": OFF})()
        col._raw_sizes = {K_KERNEL: KERNEL_SIZE}
        col._verified = cupti_raw.VERIFY_BUFFERS           # the size walk verified
        cb = cupti_raw._ctypes_callbacks(libcupti, col._raw_buffer, col.wants_offsets)
        cb.on_ref, cb.max_shipped, cb.shipped = col._raw_ref, 8, col._shipped
        col._raw_cb = cb
        agent.gpu.collector = col
        agent.gpu.sink("cupti_layout", LAYOUT)
        for i in range(2):
            stage(libcupti, pack_sizes([kernel(10 * i + j, 100 * j + 1, 100 * j + 50) for j in range(3)]),
                  K_KERNEL, KERNEL_SIZE)
            cb.flush_all(0)
        assert col.shipped() == 2 and col.counts["ref_buffers"] == 2
        end = time.monotonic() + 5
        while (col.shipped() or srv.stats().get("raw_records", 0) < 6) and time.monotonic() < end:
            agent.gpu.send()
            agent._handle(agent.ch.pump(0.02))
        recs = [r for r in srv.poll() if type(r).__name__ == "KernelRecord"]
        assert [r.correlation_id for r in recs] == [0, 1, 2, 10, 11, 12]
        assert recs[1].start_ns == 101 + OFF
        assert col.shipped() == 0 and len(cb._free) >= 1          # freed back into the pool
        st = srv.stats()
        assert st["ref_frames"] == 2 and st.get("raw_frames", 0) == 0
    finally:
        cb.on_ref = cb.on_buffer = cb.want_offsets = None
        sock.close()
        srv.close()
