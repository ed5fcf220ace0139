"""stacklens.introspect on this very process and on fake /proc trees: no root needed."""

from __future__ import annotations

import os
import struct
import sys
import threading

import pytest

from stacklens.errors import MemoryReadError, NoSuchProcess
from stacklens.introspect.cpython import find_python
from stacklens.introspect.debug_offsets import DEBUG_COOKIE, parse_debug_header
from stacklens.introspect.memory import ProcMem, read_u64
from stacklens.introspect.procfs import ProcFS


def test_find_python_finds_this_interpreter():
    tp = find_python(os.getpid(), symbols=("PyEval_EvalCode",))
    assert tp.version == tuple(sys.version_info[:3])
    assert tp.minor == sys.version_info[:2]
    assert tp.version_source == "Py_Version" and tp.hexversion == sys.hexversion
    assert {"_PyRuntime", "Py_Version", "PyEval_EvalCode"} <= set(tp.symbols)
    assert os.path.basename(tp.binary).startswith(("libpython", "python"))
    with ProcMem(os.getpid()) as mem:                      # the addresses are this process's
        assert read_u64(mem, tp.symbols["Py_Version"]) & 0xFFFFFFFF == sys.hexversion


def test_debug_offsets_header():
    blob = DEBUG_COOKIE + struct.pack("<QQ", 0x030D01F0, 1) + bytes(8)
    head = parse_debug_header(blob)
    assert head is not None and head.version == (3, 13) and head.free_threaded
    assert parse_debug_header(b"notdebug" + blob[8:]) is None
    assert parse_debug_header(blob[:20]) is None


def test_proc_mem_raises_memory_read_error_which_is_an_oserror():
    with ProcMem(os.getpid()) as mem:
        with pytest.raises(MemoryReadError) as e:
            mem.read(0x10, 8)
        assert isinstance(e.value, OSError) and e.value.errno
    with pytest.raises(NoSuchProcess):
        ProcMem(2 ** 22 + 12345)


def test_stat_keeps_a_comm_with_parentheses_and_spaces(tmp_path):
    (tmp_path / "42").mkdir()
    (tmp_path / "42" / "stat").write_text("42 (a) b (c) Z 1 2 3 4 5 64 0 0 0 0 7 8 0 0 0 0 0 0 99\n")
    procfs = ProcFS(tmp_path)
    comm, fields = procfs.stat(42)
    assert comm == "a) b (c" and fields[0] == "Z" and procfs.state(42) == "Z"
    assert procfs.starttime(42) == 99
    assert procfs.cpu_time_ns(42) == 15 * 1_000_000_000 // os.sysconf("SC_CLK_TCK")
    with pytest.raises(NoSuchProcess):
        procfs.stat(43)


def test_host_tids_of_this_process():
    assert ProcFS().host_tids(os.getpid())[threading.get_native_id()] == threading.get_native_id()
    assert ProcFS().in_own_root(os.getpid())
