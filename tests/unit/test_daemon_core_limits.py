"""Daemon limits, as unit tests with real sessions, joiners and trees over fake probes.

- Ended sessions are retired to their final profile and capped: 2,000 attach/detach cycles of
  distinct processes keep RSS within 20% of the one-session level (issue 17 acceptance 7).
- What cannot be profiled is refused with the reason: kernel threads (by PF_KTHREAD, the comm
  escaped), zombies (as exited, not as kernel threads), the daemon itself, PIDs
  out of range, a PID 1 the kernel hides from root (not "run stacklens as root").
"""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest

from stacklens.cct import Frame
from stacklens.daemon import core, nodescan, pslist, retired
from stacklens.daemon.core import Daemon
from stacklens.daemon.retired import ClosedSession
from stacklens.daemon.discovery import ProcFS
from stacklens.daemon.session import ProcessSession
from stacklens.errors import AttachError, InputError, NoSuchProcess, PermissionDenied
from tests.fakes.sources import FakeEvent

PATHS_PER_SESSION = 100


class QuickProbes:
    """Fake probes whose poll returns at once (a detach then costs no poll interval)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid

    def attach(self):
        return type("Report", (), {"notes": ["quick fake probes"]})()

    def poll(self, timeout_ms: int = 100, max_events: int = 1 << 20):
        time.sleep(0.001)  # the fake's pace; nothing waits on it
        return []

    def stats(self):
        return {"events": 0}

    def detach(self) -> None:
        pass


def filled_session(pid, **kw):
    """A real ProcessSession whose Joiner already holds PATHS_PER_SESSION unique paths (unique
    strings per process, as a target with many code objects would send)."""
    s = ProcessSession(pid, probe_factory=lambda pid, **_: QuickProbes(pid), **kw)
    for i in range(PATHS_PER_SESSION):
        stack = (Frame.python(f"/srv/app_{pid}/train.py", "main", 1),
                 Frame.python(f"/srv/app_{pid}/model_{i}.py", f"layer_{pid}_{i}", 10 + i))
        s.joiner.on_bpf(FakeEvent(kind="cpu_sample", py_stack=stack))
    return s


def rss_bytes() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def one_cycle(d: Daemon, keep: bool = False):
    p = subprocess.Popen(["sleep", "600"])
    try:
        d.attach(p.pid)
        if keep:
            return p
        d.detach(p.pid)
    finally:
        if not keep:
            p.kill()
            p.wait()
    return p


@pytest.mark.timeout(600)
def test_two_thousand_attach_detach_cycles_keep_rss_at_the_one_session_level():
    d = Daemon(session_factory=filled_session)
    for _ in range(5):  # warm-up: imports, allocator arenas, thread stacks
        one_cycle(d)
    d.tidy()
    p = one_cycle(d, keep=True)
    one_session = rss_bytes()
    snap = d.snapshot(p.pid)
    assert snap.total("cpu_samples") == PATHS_PER_SESSION
    assert snap.node_count > PATHS_PER_SESSION  # a real tree with the data in it
    d.detach(p.pid)
    p.kill()
    p.wait()
    peak = 0
    last = None
    for i in range(2000):
        last = one_cycle(d)
        if i % 250 == 249:
            d.tidy()
            peak = max(peak, rss_bytes())
    d.tidy()
    end = rss_bytes()
    print(f"RSS one session {one_session / 2**20:.1f} MiB, peak {peak / 2**20:.1f} MiB, "
          f"end {end / 2**20:.1f} MiB after 2,000 cycles")
    assert max(peak, end) <= 1.2 * one_session, (one_session, peak, end)
    assert len(d.closed) <= retired.MAX_CLOSED
    assert all(isinstance(r, ClosedSession) for r in d.closed.values())
    # the last session's final profile is still there for a report, and nothing is live
    rec = d.session(last.pid)
    assert rec.state == "detached" and rec.snapshot().total("cpu_samples") == PATHS_PER_SESSION
    assert not d.active() and d.counters["detaches"] == 2006


def test_a_session_that_ends_by_itself_is_retired_too():
    d = Daemon(session_factory=filled_session)
    p = subprocess.Popen(["sleep", "600"])
    d.attach(p.pid)
    p.kill()
    p.wait()
    deadline = time.monotonic() + 30
    while not isinstance(d.closed.get(p.pid), ClosedSession):  # target exit → on_close → retire thread
        assert time.monotonic() < deadline, "the ended session was not retired"
        time.sleep(0.02)
    rec = d.session(p.pid)
    assert rec.state == "exited" and rec.snapshot().total("cpu_samples") == PATHS_PER_SESSION
    assert rec.snapshot(window_s=10.0).total("cpu_samples") == PATHS_PER_SESSION  # the final profile
    assert rec.agent is None and "events" in rec.stats() and not d.active()


def test_closed_profiles_are_capped_by_bytes(monkeypatch):
    monkeypatch.setattr(retired, "MAX_CLOSED_BYTES", 1)  # every profile is over it: only the newest stays
    d = Daemon(session_factory=filled_session)
    pids = [one_cycle(d).pid for _ in range(3)]
    assert list(d.closed) == [pids[-1]]
    with pytest.raises(NoSuchProcess):
        d.session(pids[0])


class FakeProc(ProcFS):
    def __init__(self, files: dict[tuple[int, str], str | Exception]) -> None:
        super().__init__("/nonexistent")
        self.files = files

    def read(self, pid: int, name: str) -> str:
        v = self.files.get((pid, name))
        if v is None:
            raise NoSuchProcess(f"no process with PID {pid}")
        if isinstance(v, Exception):
            raise v
        return v


def _stat(pid: int, comm: str, flags: int) -> str:
    return f"{pid} ({comm}) S 0 0 0 0 -1 {flags} 0 0 0 0"


def test_kernel_threads_the_daemon_itself_and_bad_pids_are_refused():
    made = []
    d = Daemon(session_factory=lambda *a, **k: made.append(a))
    for pid in (2, 3):  # kthreadd, and one kernel thread found through its PF_KTHREAD flag
        with pytest.raises(InputError, match="kernel thread"):
            d.attach(pid)
    with pytest.raises(InputError, match="stacklensd itself"):
        d.attach(os.getpid())
    for pid in (0, -1, 2**31, 2**40):
        with pytest.raises(InputError, match="invalid PID"):
            d.attach(pid)
    # a kernel thread by flags alone, its comm escaped; no cmdline and no exe without the flag is a
    # process on its way out, not a kernel thread (fake /proc)
    fake = Daemon(session_factory=lambda *a, **k: made.append(a), procfs=FakeProc({
        (77, "stat"): _stat(77, "kworker/0:1\x1b[2J", core.PF_KTHREAD | 0x40),
        (78, "stat"): _stat(78, "odd", 0), (78, "cmdline"): ""}))
    with pytest.raises(InputError, match="kernel thread") as e:
        fake.attach(77)
    assert "\x1b" not in str(e.value) and "kworker/0:1\\x1b[2J" in str(e.value)
    with pytest.raises(NoSuchProcess, match="is exiting"):
        fake.attach(78)
    assert not made and not d.sessions and not fake.sessions


def test_a_zombie_is_refused_as_exited_not_as_a_kernel_thread():
    made = []
    d = Daemon(session_factory=lambda *a, **k: made.append(a))
    child = subprocess.Popen(["true"])  # not waited for until the end: a zombie meanwhile
    try:
        deadline = time.monotonic() + 10
        while Path(f"/proc/{child.pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z":
            assert time.monotonic() < deadline, "the child did not become a zombie"
            time.sleep(0.01)
        with pytest.raises(NoSuchProcess, match=f"process {child.pid} has exited \\(zombie\\)"):
            d.attach(child.pid)
    finally:
        child.wait()
    assert not made and not d.sessions


def test_pid_1_hidden_from_root_is_refused_with_the_reason_not_run_as_root():
    denied = PermissionDenied("cannot read /proc/1/maps: run stacklens as root or with CAP_SYS_PTRACE")
    d = Daemon(session_factory=lambda *a, **k: pytest.fail("must not attach"), procfs=FakeProc({
        (1, "stat"): _stat(1, "init", 0x400100), (1, "cmdline"): "/sbin/init\0", (1, "maps"): denied}))
    with pytest.raises(PermissionDenied) as e:
        d.attach(1)
    if os.geteuid() == 0:
        assert "run stacklens as root" not in str(e.value)
        assert "refuses stacklensd (root)" in str(e.value) and "cannot be profiled" in str(e.value)
    else:  # not root: the advice to run as root is right
        assert "run stacklens as root" in str(e.value)


def test_processes_have_their_true_state(monkeypatch):
    """A process never attached has no session (the service says "not attached"); a detached
    one keeps its closed session; once its PID names another process (another start time),
    that closed session is not the new process's."""
    t = subprocess.Popen(["sleep", "60"])
    try:
        d = Daemon(session_factory=filled_session)
        monkeypatch.setattr(pslist, "scan", lambda procfs, gpu_only=True: [])
        assert [(i.pid, s) for i, s in pslist.list_processes(d)] == []
        d.attach(t.pid)
        [(info, s)] = pslist.list_processes(d)
        assert info.pid == t.pid and s.state == "attached"
        d.detach(t.pid)
        monkeypatch.setattr(pslist, "scan", lambda procfs, gpu_only=True: [pslist.describe_process(t.pid, procfs)])
        [(info, s)] = pslist.list_processes(d)
        assert isinstance(s, ClosedSession) and s.state == "detached"
        monkeypatch.setattr(d.closed[t.pid], "proc_start", s.proc_start - 1)   # as after a PID reuse
        [(info, s)] = pslist.list_processes(d)
        assert info.pid == t.pid and s is None
    finally:
        t.kill()
        t.wait()


def test_a_session_that_ended_with_its_process_is_listed_as_exited(monkeypatch):
    """ps lists a session whose process exited (its final profile is kept for `report PID`); a
    plain detach of a process that exited later is not listed."""
    t = subprocess.Popen(["sleep", "60"])
    u = subprocess.Popen(["sleep", "60"])
    try:
        d = Daemon(session_factory=filled_session)
        monkeypatch.setattr(pslist, "scan", lambda procfs, gpu_only=True: [])
        d.attach(t.pid)
        d.attach(u.pid)
        d.detach(u.pid)
        d.detach(t.pid)
        d.closed[t.pid].state = "exited"          # as its aggregation thread leaves it at target exit
        for p in (t, u):
            p.kill()
            p.wait()
        listed = {s.pid: s.state for _, s in pslist.list_processes(d)}
        assert listed == {t.pid: "exited"}
    finally:
        for p in (t, u):
            if p.poll() is None:
                p.kill()
                p.wait()


def test_warm_up_prepares_one_program_per_cpython_build(monkeypatch):
    """The daemon compiles ahead for the torch/JAX processes running (one per CPython build, at
    most two over its life); a process that cannot be prepared is counted, not raised."""
    from stacklens.daemon.discovery import ProcessInfo

    procs = [ProcessInfo(11, "a", "/x", python="3.11 (/usr/bin/python3.11)"),
             ProcessInfo(12, "b", "/x", python="3.11 (/usr/bin/python3.11)"),
             ProcessInfo(13, "c", "/x", python=None),
             ProcessInfo(14, "d", "/x", python="3.12 (/opt/py/bin/python3.12)"),
             ProcessInfo(15, "e", "/x", python="3.13 (/opt/py/bin/python3.13)")]
    monkeypatch.setattr(nodescan, "scan", lambda procfs, gpu_only=True: procs)
    prepared = []

    def prepare(pid):
        prepared.append(pid)
        if pid == 14:
            raise AttachError("BPF compile failed")
        return True

    d = Daemon(session_factory=filled_session, prepare=prepare)
    assert d.warm_up() == 2                       # 3.11, then 3.12, whose compile failed
    assert prepared == [11, 14]
    assert d.counters["warm_up_compiles"] == 1 and d.counters["warm_up_failures"] == 1
    assert d.warm_up_done() and d.warm_up() == 0 and prepared == [11, 14]   # for the daemon's life

    # a process that exits before its compile: its build is tried again with the next one
    procs[0] = ProcessInfo(21, "f", "/x", python="3.10 (/usr/bin/python3.10)")
    gone = {21}

    def prepare2(pid):
        if pid in gone:
            gone.clear()
            raise NoSuchProcess("exited")
        prepared.append(pid)
        return True

    d2 = Daemon(session_factory=filled_session, prepare=prepare2)
    assert d2.warm_up() == 2 and prepared[-2:] == [12, 14]    # 3.10 skipped, 3.11 and 3.12 done
    assert d2.warm_up() == 0

    # an attached process is left alone
    d3 = Daemon(session_factory=filled_session, prepare=lambda pid: prepared.append(pid) or True)
    d3.sessions[12] = None
    prepared.clear()
    d3.warm_up()
    assert 12 not in prepared
    assert Daemon(session_factory=filled_session).warm_up() == 0   # no prepare: no warm-up
