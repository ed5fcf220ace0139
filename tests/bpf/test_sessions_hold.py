"""Issue 26.3 and 26.4 as root, with a real stacklensd and the real CLI:

- an attach slowed on purpose (STACKLENSD_TEST_ATTACH_GATE holds it until a file exists) and
  longer than the client's wait: the CLI says it goes on, `ps` shows it attaching, a second
  `attach` follows it and says "attached" once it completes; a detach during a held attach
  cancels it and the process ends detached;
- `record --format json` to stdout: the program's own output goes to stderr, never into the JSON.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.lines import read_line

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
TARGET = REPO / "tests" / "targets" / "named_loop.py"

pytestmark = pytest.mark.bpf


@pytest.fixture
def held_daemon(tmp_path, bpf_available):
    """stacklensd whose attaches wait for the file `gate` (the test hook)."""
    sock, gate = tmp_path / "run" / "s.sock", tmp_path / "gate"
    log = open(tmp_path / "stacklensd.log", "w")
    proc = subprocess.Popen([str(BIN / "stacklensd"), "--socket", str(sock), "--metrics-address", "off"],
                            stdout=subprocess.PIPE, stderr=log, text=True,
                            env={**os.environ, "STACKLENSD_TEST_ATTACH_GATE": str(gate)})
    try:
        line = proc.stdout.readline()
        assert "ready" in line, (line, (tmp_path / "stacklensd.log").read_text())
        yield sock, gate
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        proc.stdout.close()
        log.close()


@pytest.fixture
def targets():
    procs: list[subprocess.Popen] = []

    def start(name: str) -> int:
        p = subprocess.Popen([sys.executable, str(TARGET), name], stdout=subprocess.PIPE, text=True)
        procs.append(p)
        assert p.stdout.readline().strip() == "ready"
        return p.pid

    yield start
    for p in procs:
        p.kill()
        p.wait()
        p.stdout.close()


def cli(sock, *args) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / "stacklens"), "--socket", str(sock), *args], capture_output=True, text=True,
                          timeout=300)


def _line_with(stream, text: str, timeout_s: float = 120) -> str:
    """The first line of `stream` (a pipe) that contains `text`."""
    while True:
        try:
            line = read_line(stream, timeout_s)
        except TimeoutError:
            raise AssertionError(f"no line with {text!r}") from None
        assert line, f"the stream ended before a line with {text!r}"
        if text in line:
            return line


@pytest.mark.timeout(600)
def test_a_held_attach_goes_on_is_shown_completes_and_a_detach_cancels_another(held_daemon, targets):
    sock, gate = held_daemon
    pid = targets("held_loop")
    r = cli(sock, "attach", str(pid), "--wait", "1")
    assert r.returncode == 13, r.stderr
    assert f"the attach of {pid} goes on in stacklensd" in r.stderr and "Traceback" not in r.stderr
    ps = cli(sock, "ps").stdout
    assert "state: attaching: held by STACKLENSD_TEST_ATTACH_GATE" in ps, ps

    follower = subprocess.Popen([str(BIN / "stacklens"), "--socket", str(sock), "attach", str(pid)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _line_with(follower.stderr, "was in progress already: following it")
        gate.touch()
        out, err = follower.communicate(timeout=300)
    finally:
        if follower.poll() is None:
            follower.kill()
            follower.communicate()
    assert follower.returncode == 0, err
    assert f"attached to {pid}" in out
    row = next(ln for ln in cli(sock, "ps").stdout.splitlines() if ln.split()[:1] == [str(pid)])
    assert row.split()[2] == "attached"

    gate.unlink()
    other = targets("cancelled_loop")
    r = cli(sock, "attach", str(other), "--wait", "1")
    assert r.returncode == 13, r.stderr
    r = cli(sock, "detach", str(other))
    assert r.returncode == 0, r.stderr
    assert f"cancelled the attach of {other}" in r.stdout and "nothing stays attached" in r.stdout
    r = cli(sock, "detach", str(other))
    assert r.returncode == 3 and "not attached" in r.stderr
    assert cli(sock, "detach", str(pid)).returncode == 0


@pytest.mark.timeout(600)
def test_record_keeps_the_programs_output_out_of_the_profile_on_stdout(bpf_available):
    prog = "print('hello from the program'); s = sum(i * i for i in range(3_000_000)); print('bye', s > 0)"
    r = subprocess.run([str(BIN / "stacklens"), "record", "--format", "json", "--", sys.executable, "-c", prog],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    profile = json.loads(r.stdout)       # the whole of stdout is the profile
    assert profile["meta"]["comm"]
    assert "hello from the program" in r.stderr and "bye True" in r.stderr
    assert "hello from the program" not in r.stdout
