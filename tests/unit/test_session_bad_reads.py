"""A session outlives every bad read (issue 26): the ring decoder, the daemon's session, `ps`.

No privilege: `bpf.decode.RingDecoder` reads records laid out as the ring holds them
(`RecordList`, the perf-fallback path) with its Python-stack map and symbolizer given as
fakes (a dict, `tests.fakes.memory.FakeMemory`); the daemon's `ProcessSession` runs over
`FakeProbes`. Nothing here waits on a clock: a session's end is waited for on its on_close.
"""

from __future__ import annotations

import logging
import os
import threading
import types

from stacklens.bpf.events_abi import SL_EV_SAMPLE, SlEvent
from stacklens.bpf.decode import PY_UNDECODABLE, RecordList, RingDecoder
from stacklens.cct import Frame
from stacklens.daemon.client import ps_lines
from stacklens.daemon.session import ProcessSession
from stacklens.pystacks.pysym import UNREADABLE_CODE, PySymbolizer, RawPyFrame, sl_pystack_struct
from tests.fakes.sources import FakeEvent, FakeProbes
from tests.unit.test_pysym_fuzz import (CODE, CODE_TYPE, LAYOUTS, TAG, bytes_obj, code_obj, table_311_all_forms,
                                        target)

LAY = LAYOUTS[1]   # 3.11
DEPTH = 4
GOOD, TRUNCATED_TABLE, UNMAPPED = CODE, CODE + 0x1000, 0xdead0000


class PyMaps:
    """The decoder's maps: `sl_py_stacks` (id -> the raw struct); no op paths (op hash 0 is
    cached as the empty path)."""

    def __init__(self, py_stacks: dict[int, bytes]):
        self.py_stacks = py_stacks

    def py_stack(self, pyid: int) -> bytes:
        return self.py_stacks[pyid]

    def op_path(self, h: int):
        raise TypeError("no op-path map here")


def py_leaf(*frames: RawPyFrame) -> bytes:
    st = sl_pystack_struct(DEPTH)()
    st.depth = len(frames)
    for i, f in enumerate(frames):
        st.frames[i].code, st.frames[i].tag, st.frames[i].offset = f.code, f.tag, f.offset
    return bytes(st)


def sample(pid: int, pyid: int) -> bytes:
    ev = SlEvent()
    ev.kind, ev.pid, ev.tid, ev.stack_id, ev.py_stack_id = SL_EV_SAMPLE, pid, pid, -1, pyid
    return bytes(ev)


def decoder_over(mem, symbolize=None) -> RingDecoder:
    """A RingDecoder whose Python stacks come from `mem` (nothing attached: no root)."""
    sym = PySymbolizer(mem, LAY, CODE_TYPE)
    if symbolize is not None:
        sym.symbolize = symbolize
    maps = PyMaps({
        1: py_leaf(RawPyFrame(GOOD, TAG, 8)),
        2: py_leaf(RawPyFrame(TRUNCATED_TABLE, TAG, 8), RawPyFrame(GOOD, TAG, 8)),
        3: py_leaf(RawPyFrame(UNMAPPED, TAG, 0), RawPyFrame(GOOD, TAG, 8)),
    })
    return RingDecoder(os.getpid(), maps, native=None, py=sym, py_max_depth=DEPTH)


def dataloader_target():
    """One good code object and, beside it, one whose line table was cut (freed and reused)."""
    mem = target(LAY, table=table_311_all_forms())
    cut_table = 0x380000
    code = bytearray(code_obj(LAY))
    code[LAY.code_linetable:LAY.code_linetable + 8] = cut_table.to_bytes(8, "little")
    mem.regions[TRUNCATED_TABLE] = code
    mem.regions[cut_table] = bytearray(bytes_obj(LAY, table_311_all_forms()[:3]))
    return mem


def test_the_ring_decode_goes_on_past_bad_code_objects_and_counts_them():
    """The reproduction of issue 26 fed to the decoder: a stack through a code object whose
    line table ends mid-entry (it raised IndexError out of poll()), one through an unmapped
    code object, then a good one — every sample decodes, the bad frames marked, counted in
    stats() and named in read_notes()."""
    s = decoder_over(dataloader_target())
    recs = RecordList([sample(s.pid, 2), sample(s.pid, 3), sample(s.pid, 1)])
    evs = s.decode(recs, 1 << 30)
    assert [ev.kind for ev in evs] == ["cpu_sample"] * 3
    good = Frame.python("/app/loader.py", "DataLoader.__iter__", 12)
    assert evs[2].py_stack == (good,)
    assert evs[0].py_stack == (good, Frame.python("/app/loader.py", "DataLoader.__iter__", 10))   # first line
    assert evs[1].py_stack == (good, UNREADABLE_CODE)
    st = s.py.stats
    assert (st.bad_linetables, st.errors, st.bad_strings) == (1, 1, 0)
    assert s.counts["py_stacks_undecodable"] == s.counts["records_undecodable"] == 0
    notes = s.read_notes()
    assert len(notes) == 1 and "1 line table(s) not decodable" in notes[0] and "1 frame(s) without" in notes[0]


def test_a_symbolizer_that_raises_marks_the_stack_and_the_next_ones_decode(caplog):
    """pysym's own net missed something (a bug): the stack is marked, not cached, counted, the
    reason kept for the notes and logged with its traceback; the session's decode goes on."""
    mem = dataloader_target()
    calls = []

    def flaky(raw):
        calls.append(raw)
        if len(calls) == 1:
            raise IndexError("index out of range")
        return PySymbolizer.symbolize(s.py, raw)

    s = decoder_over(mem, symbolize=flaky)
    with caplog.at_level(logging.WARNING, logger="stacklens.bpf.decode"):
        evs = s.decode(RecordList([sample(s.pid, 1), sample(s.pid, 1)]), 1 << 30)
    assert [ev.py_stack for ev in evs] == [PY_UNDECODABLE, (Frame.python("/app/loader.py", "DataLoader.__iter__", 12),)]
    assert s.counts["py_stacks_undecodable"] == 1
    notes = s.read_notes()
    assert len(notes) == 1 and "IndexError: index out of range" in notes[0] and "python stack at" in notes[0]
    assert any(r.exc_info and r.exc_info[0] is IndexError for r in caplog.records)


def test_a_record_that_cannot_be_decoded_is_dropped_and_counted():
    s = decoder_over(dataloader_target())
    s._op_cache = {}          # op hash 0 not cached: the op-path map is read for this record ...
    # ... and it raises a TypeError (PyMaps.op_path), not the KeyError op_path expects
    assert s.decode(RecordList([sample(s.pid, 1)]), 1 << 30) == []
    assert s.counts["records_undecodable"] == 1
    s._op_cache = {0: ()}
    assert len(s.decode(RecordList([sample(s.pid, 1)]), 1 << 30)) == 1
    assert "1 record(s) dropped" in s.read_notes()[0]


# ---- the daemon's session ------------------------------------------------------------------------

class NotesProbes(FakeProbes):
    """FakeProbes that report bad reads (read_notes) and fail their poll on demand."""

    def __init__(self, pid: int) -> None:
        super().__init__(pid)
        self.notes: list[str] = []
        self.fail: Exception | None = None

    def read_notes(self) -> list[str]:
        return list(self.notes)

    def poll(self, timeout_ms: int = 100, max_events: int = 1 << 20):
        if self.fail is not None:
            raise self.fail
        return super().poll(timeout_ms, max_events)


def start(probes: NotesProbes) -> tuple[ProcessSession, threading.Event]:
    closed = threading.Event()
    s = ProcessSession(os.getpid(), probe_factory=lambda pid, **_: probes, on_close=lambda _s: closed.set())
    s.start()
    return s, closed


def test_bad_read_notes_reach_the_profile_and_follow_the_counts():
    probes = NotesProbes(os.getpid())
    s, _ = start(probes)
    try:
        probes.push(FakeEvent("cpu_sample", py_stack=(Frame.python("a.py", "f", 1),)))
        assert s.snapshot().meta["notes"] == ["fake probes attached"]
        probes.notes = ["python frames read from freed or changing objects: 1 line table(s) not decodable"]
        first = s.snapshot()
        assert first.meta["notes"] == ["fake probes attached"] + probes.notes
        probes.notes = ["python frames read from freed or changing objects: 2 line table(s) not decodable"]
        assert s.snapshot().meta["notes"] == ["fake probes attached"] + probes.notes   # replaced, not added
        assert first.meta["notes"][-1].startswith("python frames") and "1 line" in first.meta["notes"][-1]
    finally:
        s.stop()
    assert s.snapshot().meta["notes"][-1] == probes.notes[-1]   # kept past the probes' detach


def test_a_session_that_ends_says_why_in_full_and_logs_the_traceback(caplog):
    probes = NotesProbes(os.getpid())
    with caplog.at_level(logging.ERROR, logger="stacklens.daemon.session"):
        s, closed = start(probes)
        probes.fail = IndexError("index out of range")
        with probes.cv:
            probes.cv.notify_all()
        assert closed.wait(60)
    assert s.state == "error: IndexError: index out of range"
    rec = [r for r in caplog.records if r.name == "stacklens.daemon.session"]
    assert rec and rec[0].exc_info[0] is IndexError and "index out of range" in rec[0].getMessage()
    assert probes.detached


def test_ps_prints_the_whole_state():
    """`ps` cut every state to 10 characters ("error: ind", "not attach"): short states now fit
    their column, a long one shows its first word there and all of it on the next line, escaped."""
    def row(state: str):
        return types.SimpleNamespace(pid=4242, comm="python", state=state, agent=False, gpu_time_share=float("nan"),
                                     launches_per_s=0.0, sync_wait_share=0.0, python="3.11")

    lines = ps_lines([row(st) for st in ("attached", "not attached", "error: IndexError: index out of range",
                                         "error: \x1b]0;pwned\x07")])
    assert lines[0].split()[:3] == ["PID", "COMM", "STATE"]
    assert "not attached" in lines[2] and "attached" in lines[1]
    assert lines[3].split()[2] == "error" and lines[4].strip() == "state: error: IndexError: index out of range"
    assert "\x1b" not in "".join(lines) and lines[6].strip() == "state: error: \\x1b]0;pwned\\x07"
