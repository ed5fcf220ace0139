"""The test session leaves no process behind (issue 26, acceptance 5).

Real parts: an inner pytest session in a subprocess with tests/conftest.py, whose test starts
targets and fails without ending them (one its child, one orphaned to init by a shell); the bpf
tier's ``Target`` with a target that never says `ready`. No root needed.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from stacklens.errors import NoSuchProcess
from stacklens.introspect.procfs import ProcFS

pytestmark = pytest.mark.integration

TESTS = Path(__file__).resolve().parents[1]
IDLE = TESTS / "targets" / "idle_loop.py"

LEAKY = f'''
import subprocess, sys

def test_fails_and_leaves_its_targets(tmp_path):
    child = subprocess.Popen([sys.executable, {str(IDLE)!r}], stdout=subprocess.DEVNULL)
    orphan = subprocess.run(["sh", "-c", "{sys.executable} {IDLE} >/dev/null 2>&1 & echo $!"],
                            capture_output=True, text=True, check=True).stdout.strip()
    print("PIDS", child.pid, orphan, flush=True)
    assert False, "a failing test whose targets nobody ends"
'''

TIDY = f'''
import subprocess, sys

def test_ends_its_target():
    p = subprocess.Popen([sys.executable, {str(IDLE)!r}], stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "ready"
    p.kill()
    p.wait()
    p.stdout.close()
'''


def _inner_session(tmp_path: Path, test_source: str) -> subprocess.CompletedProcess:
    shutil.copy(TESTS / "conftest.py", tmp_path / "conftest.py")
    (tmp_path / "test_inner.py").write_text(test_source)
    # the leftovers here never exit by themselves: the grace for those on their way out is cut short
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider", str(tmp_path)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "STACKLENS_TEST_EXIT_GRACE_S": "0.5",
                               "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"})


def _running(pid: int) -> bool:
    try:
        return ProcFS().state(pid) not in ("Z", "X")
    except NoSuchProcess:
        return False


def test_a_failing_test_that_leaves_targets_fails_the_session_and_they_are_ended(tmp_path):
    r = _inner_session(tmp_path, LEAKY)
    pids = [int(x) for ln in r.stdout.splitlines() if ln.startswith("PIDS") for x in ln.split()[1:]]
    assert len(pids) == 2, r.stdout + r.stderr
    assert r.returncode == pytest.ExitCode.TESTS_FAILED, r.stdout
    assert "2 process(es) left running by the test session (killed now)" in r.stdout, r.stdout
    for pid in pids:
        assert f"PID {pid}: " in r.stdout and "idle_loop.py" in r.stdout
        assert not _running(pid), f"PID {pid} still runs after the session ended"


def test_a_session_that_ends_its_targets_passes(tmp_path):
    r = _inner_session(tmp_path, TIDY)
    assert r.returncode == pytest.ExitCode.OK, r.stdout + r.stderr
    assert "left running" not in r.stdout


def test_a_target_that_never_says_ready_is_killed(monkeypatch):
    from tests.bpf import conftest as bpf

    made: list[subprocess.Popen] = []
    real = subprocess.Popen

    def popen(*a, **kw):
        made.append(real(*a, **kw))
        return made[-1]

    monkeypatch.setattr(bpf.subprocess, "Popen", popen)
    with pytest.raises(RuntimeError, match="said 'starting' instead of 'ready'"):
        bpf.Target("idle_loop.py", "starting")
    assert len(made) == 1 and made[0].returncode == -signal.SIGKILL
