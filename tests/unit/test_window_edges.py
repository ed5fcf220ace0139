"""A window's edges through a held session (issue 41): the agent answers a flush request after
the GPU records it flushed, the session waits for that answer and the BPF ring before its
snapshot, a request racing the session's end is answered at once, and a PID reused by another
process ends the session."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time
import types

import pytest

import stacklens.daemon.session as session_mod
import stacklens.inject.agent as agent_mod
from stacklens.daemon.session import ProcessSession
from stacklens.inject.agent import Agent, wire
from stacklens.inject.channel.messages import parse_message
from stacklens.records.agent import AgentFlushed, KernelRecord
from tests.fakes.sources import FakeProbes, py


# ---- the agent's side ----------------------------------------------------------------------
class FlushingCollector:
    """A GPU collector whose forced flush hands over one kernel row, as CUPTI's completion
    callback would; counts its flushes."""

    def __init__(self):
        self.sink = None
        self.forced = 0

    active = True

    def start(self, sink):
        self.sink = sink
        return True

    def poll(self):
        pass

    def flush_now(self):
        self.forced += 1
        self.sink("kernel", ["k_flushed", 1, 2, 0, 7, 1, 1, 1, 1, 1, 1])

    def stop(self):
        self.active = False

    def stats(self):
        return {"active": 1}


def _frames_until(d: socket.socket, kind: str, timeout_s: float = 30.0) -> list[dict]:
    got, msgs = bytearray(), []
    d.settimeout(timeout_s)
    while not any(m.get("t") == kind for m in msgs):
        chunk = d.recv(1 << 16)
        assert chunk, f"the agent closed the socket before a {kind!r}: {msgs}"
        got.extend(chunk)
        msgs, used = wire.decode_all(got)
    return msgs


def test_the_agent_answers_a_flush_after_the_records_it_flushed(monkeypatch):
    gpu = FlushingCollector()
    real_sub = agent_mod._sub
    monkeypatch.setattr(agent_mod, "_sub", lambda name: types.SimpleNamespace(
        select_collector=lambda load, note: gpu) if name == "gpu" else real_sub(name))
    a, d = socket.socketpair()
    try:
        d.sendall(wire.encode({"t": "config", "sample_hz": 50.0, "gpu": True, "jax": False, "inductor": False}))
        agent = Agent(a, "tok")
        t = threading.Thread(target=agent.run, daemon=True)
        t.start()
        _frames_until(d, "hello")
        before = time.monotonic_ns()
        d.sendall(wire.encode({"t": "flush", "id": 3}) + wire.encode({"t": "flush", "id": 4}))
        msgs = _frames_until(d, "flushed")
        kinds = [m["t"] for m in msgs]
        flushed = next(m for m in msgs if m["t"] == "flushed")
        # one flush answers both requests, after the kernel record it flushed
        assert flushed["id"] == 4 and flushed["t_ns"] >= before, flushed
        assert "kernel" in kinds and kinds.index("kernel") < kinds.index("flushed"), kinds
        assert gpu.forced == 1
        [rec] = parse_message(flushed)
        assert rec == AgentFlushed(4, flushed["t_ns"])
        d.sendall(wire.encode({"t": "stop"}))
        t.join(30)
        assert not t.is_alive()
    finally:
        a.close()
        d.close()


def test_a_flush_message_from_a_hostile_agent_is_checked():
    from stacklens.inject.channel.validate import ProtocolError

    for bad in ({"t": "flushed", "id": -1, "t_ns": 1}, {"t": "flushed", "id": "x", "t_ns": 1},
                {"t": "flushed", "id": 1, "t_ns": 1.5}):
        with pytest.raises(ProtocolError):
            parse_message(bad)


# ---- the session's side --------------------------------------------------------------------
class FlushingAgent:
    """An AgentSource that answers each flush request with a kernel record, then its answer,
    after `delay_s` (None: never)."""

    def __init__(self, delay_s: float | None):
        self.delay_s = delay_s
        self.q: list = []
        self.lock = threading.Lock()
        self.asked = 0

    def request_flush(self):
        self.asked += 1
        fid = self.asked
        if self.delay_s is not None:
            def answer():
                time.sleep(self.delay_s)
                with self.lock:
                    self.q.append(AgentFlushed(fid, time.monotonic_ns()))
            threading.Thread(target=answer, daemon=True).start()
        return fid

    def poll(self, max_n=None):
        with self.lock:
            out, self.q = self.q, []
        return out

    def stop(self):
        return True

    def close(self):
        pass


@pytest.fixture
def sleeper():
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    yield p
    p.kill()
    p.wait()


def _session(pid: int, agent) -> ProcessSession:
    s = ProcessSession(pid, agent=agent is not None, probe_factory=FakeProbes,
                       agent_factory=lambda *a, **k: agent, gpu_vendor="cupti")
    s.start()
    return s


def test_an_edge_waits_for_the_agents_answer_and_the_ring(sleeper):
    agent = FlushingAgent(delay_s=0.3)
    s = _session(sleeper.pid, agent)
    try:
        t0 = time.monotonic()
        snap, missing = s.edge(timeout_s=30)
        assert missing == [] and time.monotonic() - t0 >= 0.3   # it waited for the answer
        assert s.read_up_to_ns > 0 and agent.asked == 1
        assert snap is not None
    finally:
        s.stop()


def test_an_edge_says_what_it_could_not_wait_for(sleeper):
    s = _session(sleeper.pid, FlushingAgent(delay_s=None))
    try:
        _snap, missing = s.edge(timeout_s=0.3)
        assert missing == ["the agent did not answer its flush within 0.3s"], missing
    finally:
        s.stop()


def test_an_edge_on_a_session_whose_agent_is_not_connected_says_so(sleeper):
    class Gone(FlushingAgent):
        def request_flush(self):
            return None

    s = _session(sleeper.pid, Gone(delay_s=None))
    try:
        _snap, missing = s.edge(timeout_s=5)
        assert missing == ["the agent was not connected to flush its GPU records"], missing
    finally:
        s.stop()


def test_records_before_the_answer_are_joined_when_the_edge_is_reached(sleeper):
    """The answer is taken off the agent's queue after the records before it: a kernel record
    queued before the answer is in the snapshot the edge returns (unseen: no launch probed)."""
    agent = FlushingAgent(delay_s=None)
    s = _session(sleeper.pid, agent)
    try:
        fid = None

        def ask():
            nonlocal fid
            fid = FlushingAgent.request_flush(agent)
            with agent.lock:
                agent.q.append(KernelRecord("k", 1_000, 5_000, 0, 7, 42, (1, 1, 1), (1, 1, 1)))
                agent.q.append(AgentFlushed(fid, time.monotonic_ns()))
            return fid

        agent.request_flush = ask
        snap, missing = s.edge(timeout_s=30)
        assert missing == []
        assert snap.total("gpu_time_ns") == 4_000
    finally:
        s.stop()


def test_a_request_racing_the_sessions_end_is_answered_at_once():
    """Snapshots asked again and again while sessions end with their process: none waits for a
    thread that has gone (the old check-then-queue race waited 10 s)."""
    worst = 0.0
    for _ in range(20):
        p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        s = _session(p.pid, None)
        stop = threading.Event()
        times: list[float] = []

        def hammer():
            while not stop.is_set():
                t0 = time.monotonic()
                s.snapshot()
                times.append(time.monotonic() - t0)

        h = threading.Thread(target=hammer, daemon=True)
        h.start()
        p.kill()
        p.wait()
        s._thread.join(30)
        stop.set()
        h.join(30)
        assert not h.is_alive() and s.state == "exited"
        worst = max([worst, *times])
        s.stop()
    assert worst < 1.0, worst


def test_an_edge_asked_while_the_ended_session_tears_down_is_answered(sleeper):
    """A window sees its process's exit (the session's state) while the session still tears
    down and asks for its end edge then: answered once the teardown ends, not after its timeout
    (a window waited 70 s and failed in CI)."""
    box: dict = {}

    class SlowTeardown(FakeProbes):
        def detach(self):
            def window():
                box["edge"] = s.edge(timeout_s=600)
            box["window"] = threading.Thread(target=window, daemon=True)
            box["window"].start()
            deadline = time.monotonic() + 30
            while not s.edges.gate.pending and "edge" not in box and time.monotonic() < deadline:
                time.sleep(0.001)       # the edge is queued behind a thread that is ending
            super().detach()

    s = ProcessSession(sleeper.pid, probe_factory=SlowTeardown)
    s.start()
    sleeper.kill()
    sleeper.wait()
    s._thread.join(30)
    box["window"].join(30)
    assert not box["window"].is_alive(), "the end edge was never answered"
    _snap, missing = box["edge"]
    assert s.state == "exited" and missing == []
    s.stop()


def test_a_pid_reused_by_another_process_ends_the_session(sleeper, monkeypatch):
    s = _session(sleeper.pid, None)
    try:
        real = session_mod.process_start
        monkeypatch.setattr(session_mod, "process_start",
                            lambda pid, procfs=None: (real(pid, procfs) or 0) + 1)   # another start time
        s._thread.join(30)
        assert s.state == "exited"
    finally:
        s.stop()


# ---- exact edges: what comes after an edge waits for its snapshot --------------------------
def test_the_gate_holds_what_comes_after_the_first_edge_and_lets_it_go_after():
    from stacklens.daemon.edges import Edge, EdgeGate
    from tests.fakes.sources import FakeEvent

    g = EdgeGate()
    g.pending.append(Edge(100, 7, 30.0))
    evs = [FakeEvent(kind="cpu_sample", ktime_ns=t) for t in (50, 100, 150)]
    assert [e.ktime_ns for e in g.bpf(evs)] == [50, 100]
    recs = ["a", AgentFlushed(6, 1), "b", AgentFlushed(7, 2), "c"]
    assert g.agent(recs) == ["a", AgentFlushed(6, 1), "b", AgentFlushed(7, 2)]
    assert g.due(read_up_to_ns=99) is None                     # the ring not read past it yet
    edge = g.due(read_up_to_ns=100)
    assert edge is g.pending[0] and edge.missing(100) == []
    assert g.agent(["d"]) == [] and g.bpf([]) == []            # still held while it waits
    g.pending.popleft()
    assert [e.ktime_ns for e in g.bpf([])] == [150] and g.agent(["e"]) == ["c", "d", "e"]


def test_an_edge_past_its_deadline_says_what_it_missed():
    from stacklens.daemon.edges import Edge

    e = Edge(100, 3, 0.0, missing_agent=False)
    assert e.missing(50) == ["the BPF ring was not read up to it within 0s",
                             "the agent did not answer its flush within 0s"]
    assert e.missing(50, ended=True) == []


def test_an_edges_snapshot_leaves_out_what_was_stamped_after_it(sleeper):
    from tests.fakes.sources import FakeEvent

    made = {}

    def factory(pid, **kw):
        made["p"] = FakeProbes(pid, **kw)
        return made["p"]

    s = ProcessSession(sleeper.pid, probe_factory=factory, gpu_vendor="cupti")
    s.start()
    try:
        later = time.monotonic_ns() + 3_000_000_000             # stamped 3 s after the edge below
        made["p"].push(FakeEvent(kind="cpu_sample", ktime_ns=time.monotonic_ns() - 1, py_stack=(py("a", 1),)),
                       FakeEvent(kind="cpu_sample", ktime_ns=later, py_stack=(py("b", 2),)))
        snap, missing = s.edge(timeout_s=30)
        assert missing == [] and snap.total("cpu_samples") == 1
        while s.snapshot().total("cpu_samples") < 2:           # let go once the edge was taken
            time.sleep(0.01)
    finally:
        s.stop()


def test_a_windows_growth_measures_what_its_end_measures():
    """The start's tree, taken before the GPU collector reported, marks GPU time unavailable; the
    window holds GPU time all the same (the start held none of it). `diff` would drop it."""
    from stacklens.cct import CCT, Frame, diff, growth

    path = (Frame.python("m.py", "f", 1),)
    start, end = CCT(("gpu_time_ns", "cpu_samples")), CCT(("gpu_time_ns", "cpu_samples"))
    start.add(path, "cpu_samples", 2)
    end.add(path, "cpu_samples", 5)
    end.add(path, "gpu_time_ns", 700)
    a = start.snapshot(unavailable={"gpu_time_ns"})
    b = end.snapshot()
    w = growth(b, a)
    assert "gpu_time_ns" not in w.unavailable and w.total("gpu_time_ns") == 700 and w.total("cpu_samples") == 3
    assert "gpu_time_ns" in diff(b, a).unavailable
    assert "gpu_time_ns" in growth(a, a).unavailable       # unmeasured at the end: unavailable
