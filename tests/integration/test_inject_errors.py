"""Every bad input gives a clear error, and the target stays intact."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.interpreters import pyenv_prefix
from tests.ptrace_probe import skip_module_without_ptrace
from stacklens.errors import (AlreadyAttached, AttachError, InputError, NoSuchProcess, NotApplicable,
                              PermissionDenied, UnsupportedVersion)
from stacklens.inject.channel.server import AgentServer
from stacklens.inject.injector import inject_agent
from stacklens.records.agent import PySample

pytestmark = pytest.mark.integration

TARGETS = Path(__file__).resolve().parents[1] / "targets"
LOOP = "import time\nprint('ready', flush=True)\nwhile True: time.sleep(0.05)\n"


skip_module_without_ptrace()


def start(argv, ready=True):
    p = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if ready:
        assert p.stdout.readline() == "ready\n"
    return p


def stop(p):
    if p.poll() is None:
        p.kill()
    return p.communicate()


@pytest.fixture
def py_loop():
    p = start([sys.executable, "-c", LOOP])
    yield p
    stop(p)


def test_wrong_pids(tmp_path):
    for bad in (0, -5, "12", 1.5, None):
        with pytest.raises(InputError):
            inject_agent(bad, "/x.sock")
    with pytest.raises(InputError, match="itself"):
        inject_agent(os.getpid(), "/x.sock")
    dead = subprocess.Popen(["true"])
    dead.wait()
    with pytest.raises(NoSuchProcess, match="check the PID"):
        inject_agent(dead.pid, "/x.sock")
    with pytest.raises(NoSuchProcess):
        AgentServer(dead.pid, tmp_path / "a")


def test_needs_a_server(py_loop):
    with pytest.raises(InputError, match="AgentServer"):
        inject_agent(py_loop.pid, "/nonexistent.sock")


def test_non_python_process(tmp_path):
    p = subprocess.Popen(["sleep", "60"])
    try:
        with AgentServer(p.pid, tmp_path / "a") as srv:
            with pytest.raises(NotApplicable, match="not a CPython process"):
                inject_agent(p.pid, srv.path, timeout_s=2)
        assert p.poll() is None
    finally:
        p.kill()
        p.wait()


@pytest.mark.parametrize("exe", [str(pyenv_prefix("3.9.18") / "bin" / "python3.9"),
                                 str(pyenv_prefix("2.7.18") / "bin" / "python2.7")])
def test_unsupported_python(exe, tmp_path):
    if not os.path.exists(exe):
        pytest.skip(f"{exe} not installed")
    p = start([exe, "-c", LOOP.replace("print('ready', flush=True)", "import sys; sys.stdout.write('ready\\n'); sys.stdout.flush()")])
    try:
        with AgentServer(p.pid, tmp_path / "a") as srv:
            with pytest.raises(UnsupportedVersion, match="3.10 and newer"):
                inject_agent(p.pid, srv.path, timeout_s=2)
        assert p.poll() is None
    finally:
        stop(p)


def test_no_ptrace_permission(tmp_path):
    """Target runs as nobody; the injector runs as root without CAP_SYS_PTRACE."""
    p = start(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "/usr/bin/python3", "-c", LOOP])
    code = (
        "import sys\n"
        "from stacklens.errors import PermissionDenied\n"
        "from stacklens.introspect.cpython import find_python\n"
        "from stacklens.introspect.ptrace import Tracee\n"
        f"pid = {p.pid}\n"
        "for f in (lambda: find_python(pid), lambda: Tracee(pid, yama_scope=1)):\n"
        "    try:\n"
        "        f()\n"
        "    except PermissionDenied as e:\n"
        "        print('DENIED', e)\n"
    )
    try:
        r = subprocess.run(["setpriv", "--bounding-set=-sys_ptrace", "--inh-caps=-sys_ptrace", sys.executable, "-c", code],
                           capture_output=True, text=True, cwd=str(Path(__file__).resolve().parents[2]), timeout=60)
        lines = [line for line in r.stdout.splitlines() if line.startswith("DENIED")]
        assert len(lines) == 2, r.stdout + r.stderr
        assert "CAP_SYS_PTRACE" in lines[0]
        assert "Yama ptrace_scope=1" in lines[1]
        assert p.poll() is None
    finally:
        stop(p)


@pytest.mark.parametrize("when", ["stopped", "mapped", "calling"])
def test_process_exits_mid_attach(when, tmp_path):
    from stacklens.inject import ptrace_inject
    from stacklens.introspect.cpython import find_python
    p = start([sys.executable, str(TARGETS / "inject_busy.py"), str(tmp_path / "stop")])
    tp = find_python(p.pid)

    def kill_at(step):
        if step == when:
            os.kill(p.pid, signal.SIGKILL)

    with pytest.raises(NoSuchProcess, match="exited"):
        ptrace_inject.queue_pending_call(tp, b"pass", timeout_s=5, on_step=kill_at)
    p.wait(5)
    stop(p)


def test_process_exits_while_waiting_for_the_agent(tmp_path):
    p = start([sys.executable, str(TARGETS / "inject_sleep.py")])
    srv = AgentServer(p.pid, tmp_path / "a")

    def no_hello_and_the_target_dies(timeout: float) -> bool:
        # the injector is waiting for the agent's hello: the target dies then (a timer used to
        # kill it 0.5 s in, and on a quick machine the agent had said hello by then)
        if p.poll() is None:
            p.kill()
        time.sleep(timeout)
        return False

    srv.wait_hello = no_hello_and_the_target_dies
    try:
        with pytest.raises(NoSuchProcess, match="exited"):
            inject_agent(p.pid, srv.path, timeout_s=30)
    finally:
        srv.close()
        stop(p)


def test_second_attach_to_the_same_pid(py_loop, tmp_path):
    with AgentServer(py_loop.pid, tmp_path / "a") as srv:
        with pytest.raises(AlreadyAttached):
            AgentServer(py_loop.pid, tmp_path / "a")
        inject_agent(py_loop.pid, srv.path, timeout_s=5)
        with pytest.raises(AlreadyAttached, match="already attached"):
            inject_agent(py_loop.pid, srv.path, timeout_s=5)
        assert srv.stop_agent()
        inject_agent(py_loop.pid, srv.path, timeout_s=5)   # after detach it works again
        assert srv.stop_agent()
    assert py_loop.poll() is None


def test_already_traced_by_someone_else(py_loop, tmp_path):
    from stacklens.introspect.ptrace import Tracee
    t = Tracee(py_loop.pid)
    try:
        with AgentServer(py_loop.pid, tmp_path / "a") as srv:
            with pytest.raises(AttachError, match="already traced"):
                inject_agent(py_loop.pid, srv.path, timeout_s=2)
    finally:
        t.stop(time.monotonic() + 2)
        t.detach()
    assert py_loop.poll() is None


def test_garbage_from_a_hostile_client(tmp_path):
    srv = None
    # the server needs the target's pid and the target needs the server's path and token:
    # the target reads them from stdin before running inject_hostile.py
    q = subprocess.Popen([sys.executable, "-c",
                          "import sys, runpy; path, token = sys.stdin.readline().split();"
                          f"sys.argv = ['x', path, token]; runpy.run_path({str(TARGETS / 'inject_hostile.py')!r}, run_name='__main__')"],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        srv = AgentServer(q.pid, tmp_path / "a")
        q.stdin.write(f"{srv.path} {srv.token}\n")
        q.stdin.flush()
        assert q.stdout.readline() == "ready\n"
        q.stdin.write("go\n")
        q.stdin.flush()
        assert q.stdout.readline() == "done\n"
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and srv.stats().get("bye", 0) < 1:
            time.sleep(0.02)
        st = srv.stats()
        assert st["rejected_hello"] == 1 and st["rejected_oversize"] == 1, st
        assert st["rejected_json"] == 2 and st["rejected_message"] >= 11, st
        good = [r for r in srv.poll() if isinstance(r, PySample)]
        assert good == [PySample(7, 123, (("a.py", "f", 1),), False)]
        # the server still serves a legitimate connection from the target afterwards
        assert srv._thread.is_alive()
    finally:
        if srv:
            srv.close()
        stop(q)
