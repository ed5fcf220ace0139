"""Fixtures of the unit tests that talk to stacklensd over gRPC: `daemon`, a real server in this
process (tests/grpc_daemon.py) whose sessions come from `session_factory` (fake probes; a module
overrides that fixture to serve its own sessions), and `target`, a process to attach to."""

from __future__ import annotations

import subprocess

import pytest

from tests.grpc_daemon import fake_session, serving


@pytest.fixture
def session_factory():
    """What the `daemon` fixture makes its sessions with."""
    return fake_session


@pytest.fixture
def daemon(tmp_path, session_factory):
    with serving(tmp_path, session_factory) as d:
        yield d


@pytest.fixture
def target():
    """The PID of a process to attach to (a sleep), killed when the test ends."""
    p = subprocess.Popen(["sleep", "600"])
    yield p.pid
    p.kill()
    p.wait()
