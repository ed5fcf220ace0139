"""An error inside the agent loop or its detach still stops the collectors in the target."""

import socket
import sys
import types

import pytest

import stacklens.inject.agent as agent_mod
from stacklens.inject.agent import Agent, wire
from stacklens.inject.agent.sampler import Sampler


class FakeCollector:
    """start/poll/stop/stats as the agent calls them (what CUPTI enabling would be)."""

    def __init__(self, stop_raises=None):
        self.calls = []
        self.stop_raises = stop_raises

    @property
    def active(self):
        return "start" in self.calls and "stop" not in self.calls

    def start(self, sink):
        self.calls.append("start")
        return True

    def poll(self):
        self.calls.append("poll")

    def stop(self):
        self.calls.append("stop")
        if self.stop_raises is not None:
            raise self.stop_raises

    def stats(self):
        return {"active": int(self.active)}


class FakeJax:
    dropped = 0

    def __init__(self):
        self.stopped = False

    def poll(self):
        pass

    def stop(self):
        self.stopped = True


def _failing_sampler(collector, exc):
    class FailingSampler(Sampler):
        def sample(self):
            assert collector.active        # the collector is on when the loop fails
            raise exc
    return FailingSampler


@pytest.fixture
def agent_with(monkeypatch):
    """An Agent on a socketpair whose _sub gives the fake collector and a failing sampler."""
    made = []

    def make(collector, exc=RuntimeError("sampler broke")):
        real_sub = agent_mod._sub
        fake_gpu = types.SimpleNamespace(select_collector=lambda load, note: collector)
        fake_sampler = types.SimpleNamespace(Sampler=_failing_sampler(collector, exc))

        def sub(name):
            if name == "gpu":
                return fake_gpu
            if name == "sampler":
                return fake_sampler
            return real_sub(name)

        monkeypatch.setattr(agent_mod, "_sub", sub)
        a, d = socket.socketpair()
        made.extend((a, d))
        d.sendall(wire.encode({"t": "config", "sample_hz": 100.0, "gpu": True, "jax": False}))
        return Agent(a, "tok"), a, d

    yield make
    for s in made:
        s.close()


def _received(a, d):
    a.close()
    got = bytearray()
    d.settimeout(5)
    while chunk := d.recv(1 << 16):
        got.extend(chunk)
    return wire.decode_all(got)[0]


def _notes(msgs):
    return [m["msg"] for m in msgs if m["t"] == "note"]


def test_a_sampler_error_stops_the_gpu_collector_and_says_why(agent_with):
    gpu = FakeCollector()
    agent, a, d = agent_with(gpu)
    agent.jax = jax = FakeJax()
    agent.run()                                   # returns: nothing raised into the target
    assert gpu.calls[0] == "start" and "stop" in gpu.calls and not gpu.active
    assert jax.stopped
    msgs = _received(a, d)
    notes = _notes(msgs)
    assert any("RuntimeError" in n and "sampler broke" in n for n in notes), notes
    assert [m["t"] for m in msgs].count("bye") == 1


def test_a_failing_detach_still_stopped_the_collectors_first(agent_with, monkeypatch):
    """The loop fails, then so does the rest of the detach (the channel's poller): the collectors
    were stopped before it, both errors are noted, and run() still returns."""
    gpu = FakeCollector()
    agent, a, d = agent_with(gpu, exc=ValueError("loop broke"))
    agent.jax = jax = FakeJax()

    def broken_flush(batch):
        raise OSError("flush broke")

    monkeypatch.setattr(agent, "_flush", broken_flush)
    agent.run()
    assert "stop" in gpu.calls and not gpu.active and jax.stopped
    notes = _notes(_received(a, d))
    assert any("ValueError" in n and "loop broke" in n for n in notes), notes
    assert any("detach" in n and "OSError" in n and "flush broke" in n for n in notes), notes


def test_a_failing_stop_of_one_collector_still_stops_the_other(agent_with):
    class Unprintable(Exception):
        def __str__(self):
            raise RuntimeError("no str")

    gpu = FakeCollector()
    agent, a, d = agent_with(gpu)

    class BadJax(FakeJax):
        def stop(self):
            raise Unprintable()

    agent.jax = BadJax()
    agent.run()
    assert "stop" in gpu.calls and not gpu.active
    msgs = _received(a, d)
    notes = _notes(msgs)
    assert any("JAX support stop failed" in n and "Unprintable" in n for n in notes), notes
    assert any(m["t"] == "bye" for m in msgs)


def test_a_collector_whose_start_fails_part_way_is_stopped(monkeypatch):
    """start() raising after it enabled something: the agent drops the collector, so it must
    disable what was enabled there and then."""
    gpu = FakeCollector()

    def start(sink):
        gpu.calls.append("start")
        raise RuntimeError("enable failed")

    gpu.start = start
    monkeypatch.setattr(agent_mod, "_sub", lambda name, real=agent_mod._sub:
                        types.SimpleNamespace(select_collector=lambda load, note: gpu)
                        if name == "gpu" else real(name))
    a, d = socket.socketpair()
    try:
        agent = Agent(a, "tok")
        agent.gpu.start(agent_mod._sub, agent._note_error)
        assert agent.gpu.collector is None and gpu.calls == ["start", "stop"]
    finally:
        a.close()
        d.close()


def test_a_loop_error_restores_the_switch_interval_too(agent_with):
    before = sys.getswitchinterval()
    try:
        gpu = FakeCollector()
        agent, a, d = agent_with(gpu)
        agent.cfg["switch_s"] = 0.003
        agent.run()
        assert sys.getswitchinterval() == before and "stop" in gpu.calls
    finally:
        sys.setswitchinterval(before)


def test_no_jax_watcher_is_started_by_the_detach_flush(monkeypatch):
    """jax imported after the last flush: the detach's flush must not start a watcher (its
    listener would stay registered in the target, since the stops already ran)."""
    monkeypatch.setitem(sys.modules, "jax", types.ModuleType("jax"))
    started = []
    real_sub = agent_mod._sub
    monkeypatch.setattr(agent_mod, "_sub", lambda name: types.SimpleNamespace(
        JaxWatcher=lambda *a: started.append(a) or FakeJax()) if name == "jaxmeta" else real_sub(name))
    a, d = socket.socketpair()
    try:
        agent = Agent(a, "tok", config={"gpu": False})
        agent._detach(agent_mod._SampleBatch(), Sampler())
        assert agent.jax is None and started == []
        agent.detaching = False
        agent._poll_jax()                      # while attached it is started as before
        assert agent.jax is not None and len(started) == 1
    finally:
        a.close()
        d.close()
