"""An attach is the daemon's operation (issue 26.3), on a real gRPC server and the real CLI, with
the attach slowed on purpose: fake probes whose attach stops at "compiling BPF" until the test
opens a gate (the test hook; a real stacklensd takes STACKLENSD_TEST_ATTACH_GATE, tests/bpf).

- an attach longer than the client's wait: the CLI says it goes on, `ps` shows it attaching with
  its step, `report` says it is still attaching, a second `attach` follows it, and once it
  completes that CLI says "attached";
- a detach during an attach cancels it: the probes never attach, are torn down, and the process
  ends detached (also when the detach comes as the attach ends);
- a client that does not wait (wait_s 0, as before) gets the attach's end;
- the attach note counts the processes that share the BPF program, a process that exits during
  the attach is told so.
No privilege.
"""

from __future__ import annotations

import subprocess
import threading
import time

import pytest

from stacklens.daemon import client as client_mod
from stacklens.daemon import core
from stacklens.daemon import stacklens_pb2 as pb
from stacklens.cli.main import main
from stacklens.daemon.client import DaemonClient
from stacklens.daemon.attachop import AttachOp
from stacklens.daemon.core import Daemon
from stacklens.daemon.session import ProcessSession
from stacklens.errors import AlreadyAttached, AttachCancelled, AttachError, NoSuchProcess, StillAttaching
from tests.fakes.sources import FakeProbes, exiting_probes


class GatedProbes(FakeProbes):
    """Probes whose attach stops at "compiling BPF" until `gate` is set (`reached` says it got
    there): an attach as slow as the test wants. A cancelled attach stops at the next step."""

    on_phase = None

    def __init__(self, pid: int, gate: threading.Event, reached: threading.Event) -> None:
        super().__init__(pid)
        self.gate, self.reached = gate, reached

    def attach(self):
        self.on_phase("reading the target")
        self.on_phase("compiling BPF")
        self.reached.set()
        assert self.gate.wait(60), "the test never opened the gate"
        self.on_phase("attaching probes")
        return super().attach()


class Held:
    """A daemon whose attaches are held at "compiling BPF" until `gate` is set."""

    def __init__(self) -> None:
        self.gate, self.reached = threading.Event(), threading.Event()
        self.probes: dict[int, GatedProbes] = {}

    def session(self, pid, **kw):
        def probes(pid, **_):
            self.probes[pid] = GatedProbes(pid, self.gate, self.reached)
            return self.probes[pid]

        return ProcessSession(pid, probe_factory=probes, **kw)


@pytest.fixture
def held():
    return Held()


@pytest.fixture
def session_factory(held):
    return held.session


@pytest.fixture
def daemon(daemon, held):
    yield daemon
    held.gate.set()   # before the daemon stops: its stop would wait on an attach held at the gate


def _until(pred, what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def _cli(daemon, *args: str) -> int:
    return main(["--socket", str(daemon.socket_path), *args])


def _one_line_error(err: str) -> str:
    lines = [ln for ln in err.splitlines() if "error:" in ln]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


@pytest.mark.timeout(120)
def test_an_attach_longer_than_the_clients_wait_goes_on_is_shown_attaching_and_completes(
        daemon, held, target, capsys, monkeypatch):
    rc = _cli(daemon, "attach", str(target), "--wait", "0.2")
    out = capsys.readouterr()
    assert rc == StillAttaching.exit_code
    line = _one_line_error(out.err)
    assert f"the attach of {target} goes on in stacklensd" in line and "compiling BPF" in line
    assert f"attaching to {target}: compiling BPF" in out.err      # its progress, as it came
    assert held.reached.is_set() and not held.probes[target].attached

    assert _cli(daemon, "ps") == 0
    ps = capsys.readouterr().out
    row = next(ln for ln in ps.splitlines() if ln.split()[:1] == [str(target)])
    assert row.split()[2] == "attaching"
    assert "state: attaching: compiling BPF" in ps

    with DaemonClient(str(daemon.socket_path)) as c:
        with pytest.raises(AttachError, match=f"{target} is still being attached \\(compiling BPF"):
            c.snapshot(target)
        with pytest.raises(AlreadyAttached, match="being attached already"):   # other options: not joined
            c.attach(target, agent=True, wait_s=0.1)

    joined = threading.Event()
    real = client_mod._attach_progress

    def spy(pid):
        show = real(pid)

        def seen(r):
            show(r)
            if r.joined:
                joined.set()
        return seen

    monkeypatch.setattr(client_mod, "_attach_progress", spy)
    result = {}
    follower = threading.Thread(target=lambda: result.setdefault("rc", _cli(daemon, "attach", str(target))))
    follower.start()
    assert joined.wait(30), "the second attach did not join the one in progress"
    held.gate.set()
    follower.join(60)
    assert result["rc"] == 0
    out = capsys.readouterr()
    assert f"attached to {target}" in out.out and "fake probes attached" in out.out
    assert f"an attach of {target} was in progress already: following it" in out.err
    assert held.probes[target].attached
    assert _cli(daemon, "ps") == 0
    row = next(ln for ln in capsys.readouterr().out.splitlines() if ln.split()[:1] == [str(target)])
    assert row.split()[2] == "attached"


@pytest.mark.timeout(120)
def test_detach_during_an_attach_cancels_it_and_the_process_ends_detached(daemon, held, target, capsys):
    with DaemonClient(str(daemon.socket_path)) as c:
        with pytest.raises(StillAttaching):
            c.attach(target, wait_s=0.1)
    assert held.reached.wait(30)
    op = daemon.daemon.attaching[target]
    result = {}
    detacher = threading.Thread(target=lambda: result.setdefault("rc", _cli(daemon, "detach", str(target))))
    detacher.start()
    _until(lambda: op.cancelled, "the detach did not reach the attach")
    held.gate.set()                   # the attach goes on to its next step, and stops there
    detacher.join(60)
    assert result["rc"] == 0
    out = capsys.readouterr()
    assert f"cancelled the attach of {target} (at step 'compiling BPF'); nothing stays attached" in out.out
    probes = held.probes[target]
    assert not probes.attached and probes.detached
    assert target not in daemon.daemon.sessions and target not in daemon.daemon.attaching
    with DaemonClient(str(daemon.socket_path)) as c:
        with pytest.raises(AttachCancelled, match="cancelled by a detach"):   # a client following it hears why
            c._call(c.stub.WaitAttach, pb.WaitAttachRequest(pid=target, attach_id=op.id, wait_s=1))
        assert daemon.daemon.closed[target].state == "detached"
        with pytest.raises(NoSuchProcess, match="not attached"):
            c.detach(target)
        assert c.health().counters["attach_cancels"] == 1
        assert c.attach(target, wait_s=30) == ["fake probes attached"]   # and it can be attached again
        assert c.detach(target) == f"detached from {target}"


class GatedAgent:
    """An agent whose injection lasts until `gate` is set: the attach's last step."""

    def __init__(self, gate: threading.Event, reached: threading.Event) -> None:
        reached.set()
        assert gate.wait(60), "the test never opened the gate"
        self.closed = False

    def poll(self, max_n=None):
        return []

    def stop(self) -> bool:
        return True

    def close(self) -> None:
        self.closed = True


def test_a_detach_as_the_attach_ends_detaches_what_it_attached(target):
    """The detach comes during the last step (no step after it to stop at): the session that
    the attach made is stopped at once instead of installed."""
    gate, reached = threading.Event(), threading.Event()
    made = {}

    def session(pid, **kw):
        made["probes"] = FakeProbes(pid)
        made["s"] = ProcessSession(pid, probe_factory=lambda pid, **_: made["probes"],
                                   agent_factory=lambda pid, **_: GatedAgent(gate, reached), **kw)
        return made["s"]

    d = Daemon(session_factory=session)
    op, joined = d.begin_attach(target, agent=True)
    assert not joined and reached.wait(30)
    assert op.progress()[0] == "injecting the agent"
    cancelled = {}
    t = threading.Thread(target=lambda: cancelled.setdefault("note", d.detach(target)))
    t.start()
    _until(lambda: op.cancelled, "the detach did not reach the attach")
    gate.set()
    t.join(30)
    assert "cancelled the attach" in cancelled["note"]
    with pytest.raises(AttachCancelled, match="detached again"):
        op.result()
    assert made["probes"].detached and made["s"].state == "detached"
    assert target not in d.sessions and d.closed[target].state == "detached"


def test_a_client_that_does_not_wait_gets_the_attachs_end(daemon, held, target):
    """wait_s 0 (what clients sent before attaches had progress) answers at the attach's end."""
    held.gate.set()
    with DaemonClient(str(daemon.socket_path)) as c:
        r = c._call(c.stub.Attach, pb.AttachRequest(pid=target), timeout=60)
        assert r.state == "attached" and list(r.notes) == ["fake probes attached"]
        with pytest.raises(AlreadyAttached):
            c._call(c.stub.Attach, pb.AttachRequest(pid=target), timeout=60)


class SharingProbes(FakeProbes):
    """Fake probes that say what bpf/session.py says of a program compiled before, counting its
    users when it was taken (here: 8, as the issue saw with 8 processes)."""

    PROGRAM = object()

    def __init__(self, pid: int) -> None:
        super().__init__(pid)
        self._shared = self.PROGRAM

    def attach(self):
        return type("Report", (), {"notes": [
            "BPF program: compiled before, shared with 8 other attached process(es) or kept from an earlier attach"]})()


def test_the_attach_note_counts_the_processes_that_share_the_program():
    procs = [subprocess.Popen(["sleep", "600"]) for _ in range(3)]
    try:
        d = Daemon(session_factory=lambda pid, **kw: ProcessSession(pid, probe_factory=lambda p, **_: SharingProbes(p),
                                                                    **kw))
        notes = [d.attach(p.pid) for p in procs]
        assert notes[0] == ["BPF program: compiled before (compiled ahead, or kept from an earlier attach); "
                            "no other attached process uses it now"]
        assert notes[1] == ["BPF program: compiled before, shared with 1 other attached process"]
        assert notes[2] == ["BPF program: compiled before, shared with 2 other attached processes"]
        assert d.session(procs[2].pid).snapshot().meta["notes"] == notes[2]
        for p in procs:
            d.detach(p.pid)
    finally:
        for p in procs:
            p.kill()
            p.wait()


def test_a_process_that_exits_during_the_attach_is_told_so():
    p = subprocess.Popen(["sleep", "600"])
    ExitingProbes = exiting_probes(p)

    try:
        d = Daemon(session_factory=lambda pid, **kw: ProcessSession(pid, probe_factory=lambda q, **_: ExitingProbes(q),
                                                                    **kw))
        with pytest.raises(NoSuchProcess) as e:
            d.attach(p.pid)
        assert str(e.value) == (f"process {p.pid} exited while stacklensd was attaching to it (at step "
                                "'compiling BPF'); nothing was left attached")
        assert d.counters["attach_failures"] == 1 and not d.attaching and not d.sessions
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


def test_the_test_gate_holds_an_attach_until_its_file_exists_or_a_cancel(tmp_path, target, monkeypatch):
    """STACKLENSD_TEST_ATTACH_GATE, the hook a real stacklensd is slowed with (tests/bpf)."""
    gate = tmp_path / "gate"
    monkeypatch.setenv(core.ATTACH_GATE_ENV, str(gate))
    d = Daemon(session_factory=lambda pid, **kw: ProcessSession(pid, probe_factory=lambda q, **_: FakeProbes(q), **kw))
    op, _ = d.begin_attach(target)
    assert not op.wait(0, 30) and op.progress()[0].startswith(f"held by {core.ATTACH_GATE_ENV}")
    gate.touch()
    assert op.wait(timeout=30) and op.result() == ["fake probes attached"]
    d.detach(target)
    gate.unlink()
    op, _ = d.begin_attach(target)
    assert not op.wait(0, 30)
    assert "cancelled the attach" in d.detach(target)
    with pytest.raises(AttachCancelled):
        op.result()
    assert d.closed[target].state == "detached"


def test_attach_op_wait_returns_on_a_new_step_or_the_end():
    op = AttachOp(1, agent=False, cpu_hz=99, ops=True)
    assert not op.wait(0, 0.01) and not op.wait(None, 0.01)   # nothing happened
    op.advance("reading the target")
    assert not op.wait(0, 30) and op.step == 1
    assert not op.wait(None, 0.01)        # a step is not the end
    op.end(notes=["ok"])
    assert op.wait(1, 30) and op.result() == ["ok"]


@pytest.mark.parametrize("fails", [False, True])
def test_an_attach_is_found_by_its_id_between_its_last_step_and_its_end(target, fails):
    """The attach leaves the ones in progress and joins the ended ones in one step: a client that
    follows it by id in between (CI: 8 concurrent attaches, one client told "knows no attach")
    finds it, and gets its outcome."""

    known = threading.Event()   # the test has the op's id

    class Probes(FakeProbes):
        def attach(self):
            assert known.wait(30)
            if fails:
                raise AttachError("the probes could not attach")
            return super().attach()

    d = Daemon(session_factory=lambda pid, **kw: ProcessSession(pid, probe_factory=lambda q, **_: Probes(q), **kw))
    seen = []
    between = "_end_op"   # what runs after the op left `attaching`, however the attach ended
    step = getattr(d, between)

    def looked_up(*a, **kw):
        op = d.attaching.get(target)
        assert op is None, "the hook ran before the attach left the ones in progress"
        seen.append(d.attach_op(target, ids[0]))
        return step(*a, **kw)

    setattr(d, between, looked_up)
    op, _ = d.begin_attach(target)
    ids = [op.id]
    known.set()
    assert op.wait(timeout=30)
    assert seen == [op], "the attach was not found by its id while it ended"
    if fails:
        with pytest.raises(AttachError):
            op.result()
    else:
        assert op.result() == ["fake probes attached"]
        d.detach(target)
