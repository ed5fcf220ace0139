"""The bootstrap's at-fork hook (issue 45): one per process however many attaches, holding no
socket after detach, closing the agents' sockets in a child forked while attached."""

from __future__ import annotations

import os
import sys

import pytest

from stacklens.inject.bootstrap import FORK_MODULE
from stacklens.inject.channel.server import AgentServer
from tests.agent_in_process import attach, detach


@pytest.fixture
def fresh_process_state(monkeypatch):
    """As in a process no agent was ever attached to: no fork module yet; registrations counted
    (and made: the hook must work)."""
    monkeypatch.delitem(sys.modules, FORK_MODULE, raising=False)
    calls = []
    real = os.register_at_fork

    def counted(**kw):
        calls.append(kw)
        return real(**kw)

    monkeypatch.setattr(os, "register_at_fork", counted)
    return calls


def test_three_attaches_register_one_hook_that_holds_nothing_after_detach(tmp_path, fresh_process_state):
    srv = AgentServer(os.getpid(), tmp_path / "agents", config={"gpu": False})
    try:
        for i in range(3):
            attach(srv, nonce=str(i))
            assert len(sys.modules[FORK_MODULE].held) == 1        # this attach's socket
            detach(srv)
            srv.reset_hello()
            assert sys.modules[FORK_MODULE].held == []
    finally:
        srv.close()
    assert len(fresh_process_state) == 1 and set(fresh_process_state[0]) == {"after_in_child"}
    hook = sys.modules[FORK_MODULE].in_child
    names = {k for k in hook.__globals__ if not k.startswith("__")}
    assert names == {"held", "in_child"}, "the hook keeps an attach's namespace alive"


def test_a_child_forked_while_attached_closes_the_agents_socket(tmp_path, fresh_process_state):
    srv = AgentServer(os.getpid(), tmp_path / "agents", config={"gpu": False})
    try:
        attach(srv)
        (sock, _release), = sys.modules[FORK_MODULE].held
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:     # the child: the hook ran before this line
            try:
                os.write(w, b"%d %d" % (sock.fileno(), len(sys.modules[FORK_MODULE].held)))
            finally:
                os._exit(0)
        os.close(w)
        with os.fdopen(r, "rb") as f:
            fileno, held = map(int, f.read().split())
        os.waitpid(pid, 0)
        assert (fileno, held) == (-1, 0), "the child still holds the agent's socket"
        assert sock.fileno() != -1 and len(sys.modules[FORK_MODULE].held) == 1   # the parent's is untouched
        detach(srv)
    finally:
        srv.close()
