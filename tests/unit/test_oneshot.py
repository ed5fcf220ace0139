"""One-shot windows (issue 23) on fakes: the drain up to the window's end, the account in the
snapshot's meta, notes in every format, the empty-profile error, `doctor`'s exit status and
"n/a", and the code-object cache's check for a reused address. No privilege."""

from __future__ import annotations

import argparse
import io
import os
import subprocess
import threading
import time

import pytest

from stacklens.pystacks.pysym import PySymbolizer, RawPyFrame
from stacklens.cct import CCT, Frame, METRICS
from stacklens.cli import doctor, oneshot
from stacklens.cli.main import _oneshot_output
from stacklens.daemon.session import DRAIN_GRACE_NS, ProcessSession
from stacklens.render.folded import to_folded
from stacklens.render.textreport import render_report, window_line
from stacklens.errors import IncompleteProfile
from tests.fakes.sources import FakeEvent, FakeProbes, py
from tests.unit.test_python_layouts import CODE_TYPE, LAY, FakeMemory, put_code, table_311


class OneAtATime(FakeProbes):
    """A ring read slowly: one event per poll (as when the first native symbolization of
    libtorch holds the reader for seconds), so a snapshot taken at the deadline without a
    drain would miss most of the window."""

    def poll(self, timeout_ms: int = 100, max_events: int = 1 << 20):
        return super().poll(timeout_ms, 1)


def sample(t: int, fn: str = "step") -> FakeEvent:
    return FakeEvent("cpu_sample", ktime_ns=t, py_stack=(py(fn, 1),))


def windowed_session(probes_cls=OneAtATime, pid: int | None = None) -> tuple[ProcessSession, FakeProbes]:
    made = []

    def factory(pid, **_):
        made.append(probes_cls(pid))
        return made[0]

    s = ProcessSession(pid or os.getpid(), probe_factory=factory)
    s.start(window=True)
    return s, made[0]


def test_window_drains_everything_stamped_before_its_end_then_snapshots():
    s, probes = windowed_session()
    try:
        w0 = s.window.start_ns
        probes.push(sample(w0 - 5), sample(w0 - 1))                       # during the attach
        probes.push(*(sample(w0 + i * 1000) for i in range(200)))         # in the window

        def after_the_end():   # events stamped after the end reach the ring after it
            while s.window.end_ns is None:
                time.sleep(0.001)
            end = s.window.end_ns
            probes.push(sample(end + 1, "late"), sample(end + DRAIN_GRACE_NS + 1, "late"))

        pusher = threading.Thread(target=after_the_end)
        pusher.start()
        meta = s.close_window()
        pusher.join()
        snap = s.snapshot()
    finally:
        s.stop()
    assert snap.total("cpu_samples") == 200 == meta["cpu_samples"]
    assert meta["before_window"] == 2 and meta["after_window"] == 2
    assert meta["drained"] and meta["events_late"] == 0 and meta["events_dropped"] == 0
    assert meta["seconds"] > 0 and snap.meta["window"] == meta
    assert "late" not in to_folded(snap, "cpu_samples")


def test_window_ends_when_the_ring_is_found_empty_after_its_end():
    s, probes = windowed_session()
    try:
        probes.push(*(sample(s.window.start_ns + i) for i in range(5)))
        meta = s.close_window()   # nothing stamped later ever comes: the empty ring ends it
    finally:
        s.stop()
    assert meta["cpu_samples"] == 5 and meta["drained"]


def test_window_closes_by_itself_when_the_target_exits():
    child = subprocess.Popen(["sleep", "60"])
    s, probes = windowed_session(FakeProbes, pid=child.pid)
    try:
        probes.push(*(sample(s.window.start_ns + i) for i in range(7)))
        child.kill()
        child.wait()   # reaped: /proc/PID is gone, the session sees the exit
        assert s.wait_window(30)
        meta = s.close_window()
    finally:
        s.stop()
    assert meta["cpu_samples"] == 7 and meta["drained"] and s.state == "exited"


def snap_with(window: dict, samples: int = 0, notes=("python stacks: not applicable",)):
    t = CCT(metrics=METRICS)
    if samples:
        t.add((Frame.python("a.py", "f", 1),), "cpu_samples", samples)
    base = {"start_ns": 1, "end_ns": 5_000_000_001, "seconds": 5.0, "cpu_hz": 99, "events_dropped": 0,
            "events_late": 0, "drained": True, "drain_s": 0.05, "unjoined": 0, "before_window": 0,
            "after_window": 0, "cpu_samples": samples}
    base.update(window)
    base["expected_cpu_samples"] = None if base.get("target_cpu_s") is None else \
        round(base["target_cpu_s"] * 99)
    return t.snapshot(meta={"pid": 7, "notes": list(notes), "window": base})


def test_assess_empty_profile_of_a_busy_target_is_an_error_with_the_reason():
    lines, err = oneshot.assess(snap_with({"target_cpu_s": 2.0, "events_dropped": 40}))
    assert isinstance(err, IncompleteProfile) and err.exit_code != 0
    assert "ran 2.00s on CPU" in str(err) and "40 events dropped" in str(err)
    assert any(ln.startswith("window: 5.00s") for ln in lines)


def test_assess_sleeping_target_says_it_used_no_cpu():
    lines, err = oneshot.assess(snap_with({"target_cpu_s": 0.0}))
    assert err is None
    assert any("used 0.00s of CPU" in ln and "sleeping or blocked" in ln for ln in lines)


def test_assess_short_profile_is_an_error_and_a_full_one_is_not():
    _, err = oneshot.assess(snap_with({"target_cpu_s": 2.0}, samples=100))   # 198 due
    assert isinstance(err, IncompleteProfile) and "100 CPU samples where about 198" in str(err)
    _, err = oneshot.assess(snap_with({"target_cpu_s": 2.0}, samples=190))
    assert err is None


def test_assess_takes_a_small_count_short_by_chance_and_names_a_real_shortfall():
    # CI: a bursty target with 0.21 s of CPU (21 due) got 15 samples: 1.3 sd of a Poisson count
    _, err = oneshot.assess(snap_with({"target_cpu_s": 0.21}, samples=15))
    assert err is None
    _, err = oneshot.assess(snap_with({"target_cpu_s": 0.21}, samples=2))   # 4 sd short: not chance
    assert isinstance(err, IncompleteProfile) and "fewer samples than were due" in str(err)
    assert "no sample" not in str(err)


def args_for(fmt: str, out=None) -> argparse.Namespace:
    return argparse.Namespace(format=fmt, metric="cpu_samples", output=out, view="auto")


def test_empty_profile_writes_nothing_and_raises(capsys):
    with pytest.raises(IncompleteProfile):
        _oneshot_output(snap_with({"target_cpu_s": 1.0}), args_for("text"))
    out = capsys.readouterr()
    assert out.out == "" and "window: 5.00s" in out.err


def test_notes_reach_every_format(capsys, tmp_path):
    snap = snap_with({"target_cpu_s": 0.0})
    _oneshot_output(snap, args_for("text"))
    out = capsys.readouterr()
    assert "note: python stacks: not applicable" in out.out and "used 0.00s of CPU" in out.out
    assert "window: 5.00s" in out.out and "events dropped 0, late 0, unjoined 0" in out.out
    assert "window: 5.00s" in out.err
    _oneshot_output(snap_with({"target_cpu_s": 1.0}, samples=99), args_for("folded", str(tmp_path / "f")))
    err = capsys.readouterr().err
    assert "note: python stacks: not applicable" in err and "window: 5.00s" in err


def test_text_header_states_the_window_and_its_losses():
    text = render_report(snap_with({"target_cpu_s": 1.0, "events_late": None, "drained": False,
                                    "unjoined": 3}, samples=99), "cpu_samples")
    assert "late unknown (not drained)" in text and "unjoined 3" in text and "target CPU 1.00s" in text


def test_progress_lines_name_the_phase_and_the_time():
    buf = io.StringIO()
    p = oneshot.Progress(buf, every_s=0)
    p("compiling BPF")
    p.close()
    assert buf.getvalue().startswith("stacklens: [") and "s] compiling BPF" in buf.getvalue()


# ---- doctor ----------------------------------------------------------------------------------

def test_doctor_fails_for_a_missing_pid_and_says_na_where_nothing_applies(capsys):
    checks = doctor.process_checks(999_999_999)
    assert doctor.report(checks) == 1
    assert "[FAIL] pid 999999999" in capsys.readouterr().out
    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        for _ in range(200):   # wait for the exec (comm changes from python to sleep)
            if open(f"/proc/{sleeper.pid}/comm").read().strip() == "sleep":
                break
            time.sleep(0.01)
        checks = doctor.process_checks(sleeper.pid)
    finally:
        sleeper.kill()
        sleeper.wait()
    assert doctor.report(checks) == 0
    out = capsys.readouterr().out
    for name in ("python", "libcuda", "libamdhip64", "libtorch_cpu"):
        assert f"[n/a ] {name}" in out
    assert "FAIL" not in out


def test_doctor_exit_status_counts_failures_without_a_fix():
    out = io.StringIO()
    assert doctor.report([doctor.Check("a", True, "fine"), doctor.Check("b", False, "broken")], out) == 1
    assert doctor.report([doctor.Check("c", False, "no GPU", applies=False)], out) == 0


# ---- code-object cache -------------------------------------------------------------------------

def test_code_cache_rereads_an_address_reused_with_the_same_tag():
    m = FakeMemory()
    objs = 0x600000   # both code objects point at the same filename/name strings: same tag
    tag = put_code(m, 0x100000, "/app/a.py", "f.<locals>.<lambda>", 10, table_311((4, 0)), objs=objs)
    s = PySymbolizer(m, LAY, CODE_TYPE)
    assert s.frame(RawPyFrame(0x100000, tag, 0)) == ("python", "f.<locals>.<lambda>", "/app/a.py", 10)
    # freed; another lambda of the same file allocated at the same address
    m.put(0x100000 + LAY.code_qualname, (0x700000).to_bytes(8, "little"))
    from tests.unit.test_python_layouts import put_str
    put_str(m, 0x700000, "g.<locals>.<lambda>")
    m.put(0x100000 + LAY.code_firstlineno, (30).to_bytes(4, "little", signed=True))
    got = s.frame(RawPyFrame(0x100000, tag, 2))
    assert got == ("python", "g.<locals>.<lambda>", "/app/a.py", 30), got


def test_a_code_object_freed_since_the_probe_is_named_from_its_remains():
    m = FakeMemory()
    tag = put_code(m, 0x100000, "/usr/lib/python3.11/pathlib.py", "<module>", 1, table_311((4, 3)))
    # freed by malloc: its links over ob_refcnt/ob_type, the line table freed with it
    m.put(0x100000, (0x5619_6955_ebb0).to_bytes(8, "little") * 2)
    m.put(0x100000 + LAY.code_linetable, (0xdead_0000).to_bytes(8, "little"))
    s = PySymbolizer(m, LAY, CODE_TYPE)
    assert s.frame(RawPyFrame(0x100000, tag, 6)) == ("python", "<module>", "/usr/lib/python3.11/pathlib.py", 1)
    assert s.stats.remains == 1 and s.stats.stale == 0
    # reused by another object since: the tag no longer matches, so it stays marked
    s2 = PySymbolizer(m, LAY, CODE_TYPE)
    assert s2.frame(RawPyFrame(0x100000, tag ^ 0x40, 6)) == Frame.other("[stale code object]")


def test_a_call_returning_after_the_end_is_cut_and_a_sync_still_waiting_is_counted_up_to_it():
    """The review's window bug: a sync that began in the window and returned after it was
    counted whole (or lost, if it returned after the drain); one still waiting was invisible."""
    span: dict = {}

    class ReturnsWhileRead(FakeProbes):
        def in_flight(self):   # tid 4 returns between the read of the in-flight calls and the last drain
            got = super().in_flight()
            self.push(FakeEvent("sync", tid=4, ktime_ns=span["end"] - span["q"], api="cuCtxSynchronize",
                                duration_ns=500, py_stack=(py("both", 5),)))
            return got

    s, probes = windowed_session(ReturnsWhileRead)
    try:
        w0 = s.window.start_ns
        probes.push(sample(w0))

        def around_the_end():
            while s.window.end_ns is None:
                time.sleep(0.001)
            end = s.window.end_ns
            q = span["q"] = max(1, (end - w0) // 4)
            span["end"] = end
            # entered q before the end, returned 1 s after it
            probes.push(FakeEvent("sync", tid=2, ktime_ns=end - q, api="cuStreamSynchronize",
                                  duration_ns=q + 1_000_000_000, py_stack=(py("wait", 3),)))
            # still waiting at the close: entered 2q before the end; and one the probes give
            # both ways (it returns while they are read): counted once
            probes.waiting = [FakeEvent("sync", tid=3, ktime_ns=end - 2 * q, api="cuCtxSynchronize",
                                        py_stack=(py("hang", 4),)),
                              FakeEvent("sync", tid=4, ktime_ns=end - q, api="cuCtxSynchronize",
                                        py_stack=(py("both", 5),))]

        pusher = threading.Thread(target=around_the_end)
        pusher.start()
        meta = s.close_window()
        pusher.join()
        snap = s.snapshot()
    finally:
        s.stop()
    by_fn: dict = {}
    for p, m in snap.iter_paths():
        if m.get("sync_wait_ns"):
            fn = next(f.name for f in p if f.kind == "python")
            by_fn[fn] = by_fn.get(fn, 0) + m["sync_wait_ns"]
    q = span["q"]
    assert meta["cut_at_end"] == 1 and meta["in_flight_at_end"] == 1, meta
    assert by_fn == {"wait": q, "hang": 2 * q, "both": 500}, by_fn
    assert "syncs still waiting at the end 1" in window_line(meta)


