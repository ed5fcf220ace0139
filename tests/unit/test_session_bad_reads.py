"""A session outlives every bad read (issue 26): the ring decoder, the daemon's session, `ps`.

No privilege: `ProbeSession._decode_ring` reads records laid out as the ring holds them
(`_RecordList`, the perf-fallback path) with its Python-stack map and symbolizer replaced by
fakes (a dict, `tests.fakes.memory.FakeMemory`); the daemon's `ProcessSession` runs over
`FakeProbes`. Nothing here waits on a clock: a session's end is waited for on its on_close.
"""

from __future__ import annotations

import logging
import os
import threading
import types

from stacklens.bpf.events_abi import SL_EV_SAMPLE, SlEvent
from stacklens.bpf.pysym import UNREADABLE_CODE, RawPyFrame, Symbolizer, sl_pystack_struct
from stacklens.bpf.session import PY_UNDECODABLE, ProbeSession, _RecordList
from stacklens.cct import Frame
from stacklens.daemon.client import ps_lines
from stacklens.daemon.session import ProcessSession
from tests.fakes.sources import FakeEvent, FakeProbes
from tests.unit.test_pysym_fuzz import (CODE, CODE_TYPE, LAYOUTS, TAG, bytes_obj, code_obj, table_311_all_forms,
                                        target)

LAY = LAYOUTS[1]   # 3.11
DEPTH = 4
GOOD, TRUNCATED_TABLE, UNMAPPED = CODE, CODE + 0x1000, 0xdead0000


class PyTable(dict):
    """`sl_py_stacks` as _py_stack reads it: table[table.Key(id)] -> the raw struct."""

    Key = int


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


def session_over(mem, symbolize=None) -> ProbeSession:
    """A ProbeSession whose Python stacks come from `mem` (nothing attached: no root)."""
    s = ProbeSession(os.getpid())
    sym = Symbolizer(mem, LAY, CODE_TYPE)
    s._py = types.SimpleNamespace(symbolizer=sym, max_depth=DEPTH, symbolize=symbolize or sym.symbolize)
    s._py_table = PyTable({
        1: py_leaf(RawPyFrame(GOOD, TAG, 8)),
        2: py_leaf(RawPyFrame(TRUNCATED_TABLE, TAG, 8), RawPyFrame(GOOD, TAG, 8)),
        3: py_leaf(RawPyFrame(UNMAPPED, TAG, 0), RawPyFrame(GOOD, TAG, 8)),
    })
    return s


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
    s = session_over(dataloader_target())
    recs = _RecordList([sample(s.pid, 2), sample(s.pid, 3), sample(s.pid, 1)])
    evs = s._decode_ring(recs, 1 << 30)
    assert [ev.kind for ev in evs] == ["cpu_sample"] * 3
    good = Frame.python("/app/loader.py", "DataLoader.__iter__", 12)
    assert evs[2].py_stack == (good,)
    assert evs[0].py_stack == (good, Frame.python("/app/loader.py", "DataLoader.__iter__", 10))   # first line
    assert evs[1].py_stack == (good, UNREADABLE_CODE)
    st = s._py.symbolizer.stats
    assert (st.bad_linetables, st.errors, st.bad_strings) == (1, 1, 0)
    assert s._user["py_stacks_undecodable"] == s._user["records_undecodable"] == 0
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
        return sym.symbolize(raw)

    s = session_over(mem, symbolize=flaky)
    sym = s._py.symbolizer
    with caplog.at_level(logging.WARNING, logger="stacklens.bpf.session"):
        evs = s._decode_ring(_RecordList([sample(s.pid, 1), sample(s.pid, 1)]), 1 << 30)
    assert [ev.py_stack for ev in evs] == [PY_UNDECODABLE, (Frame.python("/app/loader.py", "DataLoader.__iter__", 12),)]
    assert s._user["py_stacks_undecodable"] == 1
    notes = s.read_notes()
    assert len(notes) == 1 and "IndexError: index out of range" in notes[0] and "python stack at" in notes[0]
    assert any(r.exc_info and r.exc_info[0] is IndexError for r in caplog.records)


def test_a_record_that_cannot_be_decoded_is_dropped_and_counted():
    s = session_over(dataloader_target())
    s._op_cache = {}          # op hash 0 not cached: the op-path map is read for this record ...
    s._bpf = None             # ... and there is none: a TypeError, not the KeyError _op_path expects
    assert s._decode_ring(_RecordList([sample(s.pid, 1)]), 1 << 30) == []
    assert s._user["records_undecodable"] == 1
    s._op_cache = {0: ()}
    assert len(s._decode_ring(_RecordList([sample(s.pid, 1)]), 1 << 30)) == 1
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
