"""The Prometheus endpoint as any local user sees it (issue 17 acceptance 6), on a real daemon
(gRPC socket, HTTP exposition) with fake probes:

- a throwaway unprivileged user (useradd, removed afterwards) gets per-process totals but no
  code locations by default; with `metrics_hotspots` the same request shows them (the control);
- 300 idle connections held by that user do not grow the daemon's threads past
  prom.WORKERS (the endpoint's cap: 1 selector thread + WORKERS), and a scrape still answers.
"""

from __future__ import annotations

import os
import secrets
import shutil
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from stacklens.daemon import prom
from stacklens.daemon.client import DaemonClient
from stacklens.daemon.core import Daemon
from stacklens.daemon.server import StacklensDaemon
from stacklens.daemon.session import ProcessSession
from tests.fakes.sources import FakeEvent, FakeProbes, py

# the system interpreter: the venv's may sit under a directory other users cannot enter
USER_PYTHON = "/usr/bin/python3"

HOLD = r"""
import socket, sys
port = int(sys.argv[1])
conns = [socket.create_connection(("127.0.0.1", port)) for _ in range(300)]
print("held", flush=True)
sys.stdin.readline()
"""


@pytest.fixture(scope="module")
def local_user():
    """A throwaway unprivileged user; skips where users cannot be made (not root, no useradd)."""
    if shutil.which("useradd") is None or shutil.which("runuser") is None or not os.path.exists(USER_PYTHON):
        pytest.skip(f"needs useradd, runuser and {USER_PYTHON}")
    name = f"slt{secrets.token_hex(3)}"
    r = subprocess.run(["useradd", "--no-create-home", "--shell", "/usr/sbin/nologin", name],
                       capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot create a throwaway user here: {r.stderr.strip()}")
    try:
        yield name
    finally:
        subprocess.run(["userdel", name], capture_output=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def as_user(user: str, *argv: str, **kw):
    return subprocess.run(["runuser", "-u", user, "--", *argv], capture_output=True, text=True, timeout=60, **kw)


def fetch_as(user: str, port: int) -> str:
    code = f"import urllib.request;print(urllib.request.urlopen('http://127.0.0.1:{port}/metrics', timeout=20).read().decode())"
    r = as_user(user, USER_PYTHON, "-I", "-c", code)
    assert r.returncode == 0, r.stderr
    return r.stdout


def scrape(port: int) -> str:
    return urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=20).read().decode()


def threads() -> int:
    return len(os.listdir("/proc/self/task"))


def start_daemon(tmp_path, name, hotspots: bool):
    probes: dict[int, FakeProbes] = {}

    def factory(pid, **kw):
        def mk(pid, **_):
            probes[pid] = FakeProbes(pid)
            return probes[pid]

        return ProcessSession(pid, probe_factory=mk, **kw)

    port = free_port()
    d = StacklensDaemon(socket_path=str(tmp_path / name / "s.sock"), metrics_address=f"127.0.0.1:{port}",
                        daemon=Daemon(session_factory=factory), metrics_hotspots=hotspots)
    d.start()
    return d, port, probes


@pytest.mark.timeout(300)
def test_an_unprivileged_user_gets_no_code_locations_and_cannot_grow_threads(tmp_path, local_user):
    target = subprocess.Popen(["sleep", "300"])
    daemons = []
    try:
        for name, hotspots in (("default", False), ("hotspots", True)):
            d, port, probes = start_daemon(tmp_path, name, hotspots)
            daemons.append(d)
            with DaemonClient(str(d.socket_path)) as c:
                c.attach(target.pid)
                probes[target.pid].push(*[FakeEvent(kind="cpu_sample", py_stack=(py("main", 1), py("secret_fn", 42)))] * 7)
                deadline = time.monotonic() + 20
                while c.snapshot(target.pid).total("cpu_samples") < 7:  # the session has the samples
                    assert time.monotonic() < deadline
                    time.sleep(0.05)
            text = fetch_as(local_user, port)
            assert "stacklens_cpu_samples_total" in text or "stacklens_cpu_samples{" in text, text[:2000]
            if hotspots:  # the control: the location is there when configured
                assert "train.py:secret_fn:42" in text
            else:
                assert "secret_fn" not in text and "train.py" not in text and "stacklens_hotspot" not in text
        d, port = daemons[0], daemons[0].http.address[1]
        scrape(port)  # the pool's worker exists
        before = threads()
        holder = subprocess.Popen(["runuser", "-u", local_user, "--", USER_PYTHON, "-I", "-c", HOLD, str(port)],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        try:
            assert holder.stdout.readline().strip() == "held"
            during = threads()
            assert "stacklens_attached_processes 1.0" in scrape(port)  # a scrape still answers
            after_scrape = threads()
        finally:
            holder.stdin.close()
            holder.wait(timeout=30)
            holder.stdout.close()
        print(f"daemon threads: {before} before, {during} with 300 idle connections, {after_scrape} after a scrape "
              f"(cap: +{prom.WORKERS}); idle connections closed by the cap: {d.http.closed_idle}")
        assert during - before <= prom.WORKERS and after_scrape - before <= prom.WORKERS
        assert d.http.closed_idle >= 300 - prom.MAX_CONNECTIONS - 1
    finally:
        for d in daemons:
            d.stop()
        target.kill()
        target.wait()
