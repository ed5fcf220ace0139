"""Shared pieces of the daemon side of the agent channel: the strict checks (inject/channel/validate.py)
that messages.py and the GPU decoders (inject/channel/gpu/) use, memory.read_cstring (NameReader's page-by-page reader), and the
injector's /proc reading of agent threads through ProcFS."""

import ctypes
import os

import pytest

from stacklens.errors import NoSuchProcess
from stacklens.inject.channel import messages, validate
from stacklens.inject.channel.gpu import cupti as cuptiraw
from stacklens.inject.channel.gpu import rows
from stacklens.inject.agent import wire
from stacklens.inject.injector import _agent_threads, _blocked_reason, _syscall_desc
from stacklens.introspect.memory import PAGE, ProcMem, read_cstring
from tests.fakes.memory import FakeMemory
from stacklens.inject.channel.validate import (ProtocolError, check_choice, check_dict, check_int, check_list,
                                       check_message, check_num, check_row, check_str)
from stacklens.introspect.procfs import ProcFS


def test_one_protocol_error_and_limits_everywhere():
    assert messages.ProtocolError is cuptiraw.ProtocolError is rows.ProtocolError is validate.ProtocolError
    assert issubclass(ProtocolError, ValueError)
    assert messages.MAX_STR == cuptiraw.MAX_STR == validate.MAX_STR == 8192
    assert messages.MAX_INT == cuptiraw.MAX_INT == (1 << 63) - 1
    assert validate.MAX_BATCH == 20000
    assert rows.MEMCPY_KINDS == ("HtoD", "DtoH", "DtoD", "HtoH", "PtoP", "memset", "other")
    assert rows.MEMCPY_KINDS[:len(wire.RAW_COPY_KINDS)] == wire.RAW_COPY_KINDS


def test_checks_accept_exact_types_in_range():
    assert check_int(0) == 0 and check_int(validate.MAX_INT) == validate.MAX_INT
    assert check_int(-5, -10, 10) == -5
    assert check_str("x" * validate.MAX_STR) == "x" * validate.MAX_STR
    assert check_num(3) == 3.0 and type(check_num(3)) is float and check_num(-1e18) == -1e18
    assert check_list([1] * 3, 3) == [1, 1, 1] and check_row([1, 2], 2) == [1, 2]
    assert check_dict({"a": 1}, 1, minlen=1) == {"a": 1}
    assert check_choice("b", ("a", "b"), "bad") == "b" and check_choice(8, (4, 8), "bad", typ=int) == 8
    msg = {"t": "x", "v": 1}
    assert check_message(msg, "x", "bad") is msg


@pytest.mark.parametrize("call, message", [
    (lambda: check_int(True), "bad integer True"),
    (lambda: check_int(1.0), "bad integer 1.0"),
    (lambda: check_int(-1), "bad integer -1"),
    (lambda: check_int(validate.MAX_INT + 1), f"bad integer {validate.MAX_INT + 1}"),
    (lambda: check_int(11, 0, 10, "bad size"), "bad size"),
    (lambda: check_str(b"x"), "bad string"),
    (lambda: check_str("xy", 1, "bad name"), "bad name"),
    (lambda: check_num(float("nan")), "bad number"),
    (lambda: check_num(True), "bad number"),
    (lambda: check_num(2e18), "bad number"),
    (lambda: check_list((1,)), "bad list"),
    (lambda: check_list([0] * 20001), "bad list"),
    (lambda: check_row([1, 2, 3], 2), "bad row"),
    (lambda: check_dict([], 4, "bad kinds"), "bad kinds"),
    (lambda: check_dict({}, 4, "bad kinds", minlen=1), "bad kinds"),
    (lambda: check_dict({i: i for i in range(5)}, 4, "bad kinds"), "bad kinds"),
    (lambda: check_choice(["a"], {"a": 1}, "bad rec"), "bad rec"),      # unhashable: no TypeError
    (lambda: check_choice("", ("a",), "bad fmt"), "bad fmt"),
    (lambda: check_choice(True, (1, 2), "bad align", typ=int), "bad align"),
    (lambda: check_message([], "x", "not x"), "not x"),
    (lambda: check_message({"t": "y"}, "x", "not x"), "not x"),
])
def test_checks_reject_with_their_message(call, message):
    with pytest.raises(ProtocolError) as e:
        call()
    assert str(e.value) == message


def test_raw_header_checks_unchanged():
    h = {"t": "cupti_raw", "off_ns": -(1 << 63), "mode": "offsets", "n_offs": cuptiraw.MAX_OFFS, "align": 16}
    assert cuptiraw._header(h) == (-(1 << 63), "offsets", cuptiraw.MAX_OFFS, 16)
    for k, v in [("off_ns", 1 << 63), ("off_ns", True), ("mode", "size"), ("n_offs", cuptiraw.MAX_OFFS + 1),
                 ("align", 3), ("align", 8.0), ("t", "cupti_layout")]:
        with pytest.raises(ProtocolError):
            cuptiraw._header({**h, k: v})
    with pytest.raises(ProtocolError, match="bad n_offs"):            # sizes mode: no offsets
        cuptiraw._header({**h, "mode": "sizes", "n_offs": 1})
    assert cuptiraw._header({**h, "mode": "sizes", "n_offs": 0})[2] == 0


def test_layout_field_errors_keep_their_messages():
    lay = {"t": "cupti_layout", "kinds": {"1": {"rec": "memset", "size": 16, "fields": {
        "kind": [0, "I"], "bytes": [8, "Q"], "start": [8, "Q"], "end": [8, "Q"], "device_id": [4, "I"],
        "stream_id": [4, "I"], "correlation_id": [4, "I"]}}}}
    assert cuptiraw.parse_layout(lay).kinds[1].size == 16
    fields = lay["kinds"]["1"]["fields"]
    for f, message in [([9, "Q"], "field 'bytes' outside the record"), ([-1, "Q"], "field 'bytes' outside the record"),
                       ([8, "d"], "bad field format 'd'"), ([8, ""], "bad field format ''"), ([8], "bad field")]:
        bad = {**lay, "kinds": {"1": {**lay["kinds"]["1"], "fields": {**fields, "bytes": f}}}}
        with pytest.raises(ProtocolError) as e:
            cuptiraw.parse_layout(bad)
        assert str(e.value) == message
    for ck, message in [({"1": "HtoD", "2": "sideways"}, "bad copy kind"), ({"x": "HtoD"}, "bad kind code 'x'"),
                        ([], "bad copy_kinds")]:
        with pytest.raises(ProtocolError) as e:
            cuptiraw.parse_layout({**lay, "copy_kinds": ck})
        assert str(e.value) == message


def test_read_cstring_page_by_page_in_fake_memory():
    base = 10 * PAGE
    mem = FakeMemory({base: b"a" * (PAGE - 3) + b"bcdef\0ghi" + b"z" * PAGE})
    reads = []
    real = mem.read
    mem.read = lambda addr, n: (reads.append((addr, n)), real(addr, n))[1]
    assert read_cstring(mem, base + PAGE - 5, 100) == b"aabcdef"
    assert reads == [(base + PAGE - 5, 5), (base + PAGE, 95)]          # never crosses a page in one read
    assert read_cstring(mem, base, 4) == b"aaaa"                         # cut at max_len
    assert read_cstring(mem, base + PAGE + 10, 0) == b""
    tail = FakeMemory({base: b"x" * PAGE})                               # next page unmapped: keep the start
    assert read_cstring(tail, base + PAGE - 2, 50) == b"xx"
    with pytest.raises(OSError):                                        # first page unmapped: raises
        read_cstring(tail, base + PAGE, 50)


def test_proc_mem_reads_own_memory_and_fails_cleanly():
    s = ctypes.create_string_buffer(b"hello kernel")
    with ProcMem(os.getpid()) as r:
        assert r.read(ctypes.addressof(s), 5) == b"hello"
        assert read_cstring(r, ctypes.addressof(s) + 6, 4096) == b"kernel"
        with pytest.raises(OSError):
            r.read(0x10, 4)
        with pytest.raises(OSError):
            r.read(2 ** 64, 4)


def test_name_reader_reads_nothing_after_close():
    s = ctypes.create_string_buffer(b"k")
    nr = cuptiraw.NameReader(os.getpid())
    assert nr.get(ctypes.addressof(s)) == "k" and nr._mem is not None
    nr.close()
    assert nr._mem is None
    assert nr.read(ctypes.addressof(s)) == f"unresolved:0x{ctypes.addressof(s):x}" and nr.unresolved == 1
    assert nr._mem is None


def _task(root, pid, tid, comm, stat_state, syscall):
    d = root / str(pid) / "task" / str(tid)
    d.mkdir(parents=True)
    (d / "comm").write_text(comm + "\n")
    (d / "stat").write_text(f"{tid} ({comm}) {stat_state} 1 2 3\n")
    if syscall is not None:
        (d / "syscall").write_text(syscall + "\n")


def test_agent_threads_and_blocked_reason_through_procfs(tmp_path):
    _task(tmp_path, 50, 50, "python3", "S", "202 0x1 0x2")
    _task(tmp_path, 50, 51, "stacklens-agent", "S", "7 0x0")
    _task(tmp_path, 50, 52, "stacklens-agent", "R", "running")
    _task(tmp_path, 50, 53, "stacklens-agent", "S", "999 0x0")
    _task(tmp_path, 50, 54, "stacklens-agent", "S", None)             # exited meanwhile: skipped
    _task(tmp_path, 50, 55, "worker) x", "S", "0 0")
    procfs = ProcFS(tmp_path)
    assert procfs.thread_comm(50, 51) == "stacklens-agent" and procfs.thread_comm(50, 55) == "worker) x"
    with pytest.raises(NoSuchProcess):
        procfs.thread_comm(50, 99)
    assert _agent_threads(procfs, 50) == {51: "state S, in the poll syscall", 52: "state R, running",
                                          53: "state S, in the syscall 999 syscall"}
    assert _agent_threads(procfs, 60) == {}
    assert _blocked_reason(procfs, 50) == "its main thread is blocked in the futex syscall"
    assert _syscall_desc("230") == "the clock_nanosleep syscall" and _syscall_desc("5") == "the syscall 5 syscall"
