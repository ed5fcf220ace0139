"""AgentLink's config to the agent: a sample rate only when given one (None: the agent's default)."""

from __future__ import annotations

import pytest

from stacklens.inject import injector
from stacklens.inject.channel import server
from stacklens.daemon.agentlink import AgentLink


class FakeServer:
    made: list["FakeServer"] = []

    def __init__(self, pid, socket_dir=None, *, config=None):
        self.pid, self.config, self.path, self.closed = pid, dict(config or {}), f"/tmp/fake-{pid}.sock", False
        FakeServer.made.append(self)

    def close(self):
        self.closed = True


@pytest.fixture
def fakes(monkeypatch):
    FakeServer.made = []
    injected = []
    monkeypatch.setattr(server, "AgentServer", FakeServer)
    monkeypatch.setattr(injector, "inject_agent",
                        lambda pid, *, socket_path, timeout_s: injected.append((pid, socket_path)) or "ok")
    return injected


def test_no_sample_hz_means_the_agents_default(fakes):
    link = AgentLink(123, sample_hz=None)
    (srv,) = FakeServer.made
    assert "sample_hz" not in srv.config
    assert srv.config == {"gpu": True, "gpu_api_records": False}
    assert fakes == [(123, srv.path)] and link.result == "ok"


def test_a_given_sample_hz_is_sent_and_wins_over_config(fakes):
    AgentLink(123, sample_hz=20, gpu_api_records=True, config={"sample_hz": 5, "gpu": False})
    (srv,) = FakeServer.made
    assert srv.config == {"gpu": False, "sample_hz": 20, "gpu_api_records": True}
    AgentLink(124, config={"sample_hz": 5})     # none given: the config's own rate goes through
    assert FakeServer.made[1].config["sample_hz"] == 5


def test_a_failed_injection_closes_the_server(monkeypatch, fakes):
    def fail(pid, *, socket_path, timeout_s):
        raise RuntimeError("ptrace refused")

    monkeypatch.setattr(injector, "inject_agent", fail)
    with pytest.raises(RuntimeError):
        AgentLink(125)
    assert FakeServer.made[0].closed
