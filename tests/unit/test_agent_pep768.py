"""The PEP 768 writer against a fake target memory laid out like CPython 3.14."""

import struct

import pytest

from stacklens.errors import AttachError, UnsupportedVersion
from stacklens.inject import pep768
from stacklens.introspect.python_layouts import remote_debug_layouts
from tests.fakes.memory import FakeMemory

RUNTIME, INTERP, TSTATE = 0x10000, 0x20000, 0x30000
# offsets the fake "CPython" reports in its _Py_DebugOffsets (arbitrary but plausible)
FINALIZING, INTERP_HEAD, THREADS_MAIN = 0x300, 0x310, 0x58
EVAL_BREAKER, SUPPORT, ENABLED, PENDING, PATH, PATH_SIZE = 0x18, 0x400, 0x900, 0x0, 0x8, 512


def fake_314(version=0x030E0AF0, enabled=1, finalizing=0, free_threaded=0, layout=0):
    rt = bytearray(0x1000)
    rt[0:8] = b"xdebugpy"
    struct.pack_into("<QQ", rt, 8, version, free_threaded)
    L = remote_debug_layouts((3, 14))[layout]
    struct.pack_into("<Q", rt, L.runtime_finalizing, FINALIZING)
    struct.pack_into("<Q", rt, L.runtime_interpreters_head, INTERP_HEAD)
    struct.pack_into("<Q", rt, L.interp_threads_main, THREADS_MAIN)
    for field, v in (("dbg_eval_breaker", EVAL_BREAKER), ("dbg_remote_debugger_support", SUPPORT),
                     ("dbg_remote_debugging_enabled", ENABLED), ("dbg_pending_call", PENDING),
                     ("dbg_script_path", PATH), ("dbg_script_path_size", PATH_SIZE)):
        struct.pack_into("<Q", rt, getattr(L, field), v)
    struct.pack_into("<Q", rt, FINALIZING, finalizing)
    struct.pack_into("<Q", rt, INTERP_HEAD, INTERP)
    interp = bytearray(0x1000)
    struct.pack_into("<Q", interp, THREADS_MAIN, TSTATE)
    struct.pack_into("<i", interp, ENABLED, enabled)
    ts = bytearray(0x1000)
    struct.pack_into("<Q", ts, EVAL_BREAKER, 0b1)          # a GIL drop request already pending
    return FakeMemory({RUNTIME: rt, INTERP: interp, TSTATE: ts})


def test_layout_candidates_for_314():
    words = [L.dbg_eval_breaker // 8 for L in remote_debug_layouts((3, 14))]
    assert words == [89, 83]


def test_layout_is_chosen_by_validating_the_target_values():
    for layout in (0, 1):
        tgt = pep768.locate(fake_314(layout=layout), RUNTIME, 42)
        assert tgt.path_size == 512 and tgt.tstate == TSTATE


@pytest.mark.parametrize("layout", [0, 1])
def test_request_writes_path_pending_flag_and_eval_breaker_bit(layout):
    mem = fake_314(layout=layout)
    tgt = pep768.request_exec(mem, RUNTIME, 42, "/tmp/boot.py")
    assert mem.read(TSTATE + SUPPORT + PATH, 13) == b"/tmp/boot.py\0"
    assert struct.unpack("<i", mem.read(TSTATE + SUPPORT + PENDING, 4))[0] == 1
    eb = struct.unpack("<Q", mem.read(TSTATE + EVAL_BREAKER, 8))[0]
    assert eb == 0b1 | pep768.EVAL_PLEASE_STOP_BIT          # existing bits kept
    assert pep768.pending(mem, tgt)
    pep768.withdraw(mem, tgt)
    assert not pep768.pending(mem, tgt)


def test_disabled_remote_debug_is_a_clear_error():
    with pytest.raises(AttachError, match="PYTHON_DISABLE_REMOTE_DEBUG"):
        pep768.request_exec(fake_314(enabled=0), RUNTIME, 42, "/tmp/boot.py")


def test_finalizing_interpreter_refused():
    with pytest.raises(AttachError, match="shutting down"):
        pep768.request_exec(fake_314(finalizing=1), RUNTIME, 42, "/tmp/boot.py")


def test_unknown_minor_is_unsupported():
    with pytest.raises(UnsupportedVersion, match="3.15"):
        pep768.request_exec(fake_314(version=0x030F00A1), RUNTIME, 42, "/tmp/boot.py")


def test_bad_cookie_and_long_path():
    mem = fake_314()
    mem.write(RUNTIME, b"notdebug")
    with pytest.raises(AttachError, match="cookie"):
        pep768.request_exec(mem, RUNTIME, 42, "/x")
    with pytest.raises(AttachError, match="too long"):
        pep768.request_exec(fake_314(), RUNTIME, 42, "/" + "a" * 600)
