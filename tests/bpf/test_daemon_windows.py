"""Profile windows through a running stacklensd are leases (issue 41, points 3 and 4), as root
with real probes: one daemon for the module (one BCC compile), targets from tests/targets.

- launches through the fake libcuda in a window through the daemon are counted as completely as
  the one-shot path counts them (of those the target made inside the window);
- `profile --agent` on a PID held without the agent exits non-zero with one line naming it;
- a target that exits during a window ends it at its exit;
- a window whose client is killed (SIGTERM, SIGHUP, SIGKILL) leaves nothing attached, the agent
  included;
- two windows on one PID at once both return complete profiles when Ctrl-C ends them, and
  `attach` during them succeeds and outlives them; ending a window that is not open is refused;
- a PID reused by another process (forced with ns_last_pid) ends the old session and the new
  process can be attached.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from stacklens.cct import Frame, export
from stacklens.daemon import stacklens_pb2 as pb
from stacklens.errors import NoSuchProcess
from tests.bpf.conftest import TARGETS
from tests.daemon_proc import Daemon, until
from tests.lines import read_line, rest

BIN = Path(sys.executable).parent


@pytest.fixture(scope="module")
def daemon(tmp_path_factory, bpf_available):
    d = Daemon(tmp_path_factory.mktemp("windows"))
    yield d
    d.stop()


def ps(d: Daemon) -> dict[int, dict]:
    r = d.cli("ps", "--json")
    assert r.returncode == 0, r.stderr
    return {p["pid"]: p for p in json.loads(r.stdout)["processes"]}


def attached(d: Daemon, pid: int) -> bool:
    p = ps(d).get(pid)
    return p is not None and p["state"] == "attached"


def agent_threads(pid: int) -> int:
    n = 0
    for t in Path(f"/proc/{pid}/task").iterdir():
        try:
            n += (t / "comm").read_text().strip() == "stacklens-agent"
        except OSError:
            continue
    return n


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def default_signals() -> None:
    """In the child: the signals the test sends act as they do on a terminal's process, even
    where this run inherited them ignored (nohup ignores SIGHUP, a background job SIGINT)."""
    for sig in (signal.SIGHUP, signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_DFL)


def daemon_threads(d: Daemon) -> str:
    """The daemon's threads now (py-spy dump), or why they could not be read."""
    from tests.bpf.pyspy import tool

    r = subprocess.run([tool("py-spy", "pip install py-spy"), "dump", "--pid", str(d.proc.pid)], capture_output=True,
                       text=True, timeout=120)
    return r.stdout + r.stderr


def profile_cmd(d: Daemon, pid: int, *extra: str) -> list[str]:
    return [str(BIN / "stacklens"), "--socket", str(d.sock), "profile", "--pid", str(pid), *extra]


def wait_for_line(proc: subprocess.Popen, text: str, timeout: float = 240) -> list[str]:
    """Reads the command's stderr until a line holds `text` (its progress lines); the lines read
    (tests/lines.py: what came after stays for `rest_of`)."""
    deadline = time.monotonic() + timeout
    seen: list[str] = []
    while (left := deadline - time.monotonic()) > 0:
        try:
            line = read_line(proc.stderr, left)
        except TimeoutError:
            break
        if line is None:
            break
        seen.append(line)
        if text in line:
            return seen
    raise AssertionError(f"no {text!r} from the command: {''.join(seen)}")


def rest_of(proc: subprocess.Popen, err: str) -> str:
    """The command's stderr after the lines wait_for_line read, then `err` (communicate()'s)."""
    return rest(proc.stderr) + err


def test_launches_in_a_window_through_the_daemon_are_counted_as_one_shot_counts_them(
        daemon, fake_libs, start_target, tmp_path):
    t = start_target("fake_cuda_ratio.py", str(fake_libs["dir"]), "3.0")
    out = tmp_path / "p.json"
    r = subprocess.run(profile_cmd(daemon, t.pid, "--duration", "5", "--format", "json", "-o", str(out)),
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    snap = export.load(out)
    window = snap.meta["window"]
    assert window["through"] == "stacklensd" and window["drained"], window
    assert t.readline(timeout=60).split()[0] == "done"
    t.send(f"window {window['start_ns']} {window['end_ns']}")
    inside = t.readline(timeout=30).split()
    made = int(inside[1]) + int(inside[2])
    counted = sum(v["launch_count"] for p, v in snap.iter_paths() if Frame.api("cuLaunchKernel") in p)
    assert made > 1000 and counted >= 0.8 * made, (counted, made)
    assert abs(counted - made) <= 0.02 * made, (counted, made)   # the one-shot path: within 1%
    until("the window's session detached", lambda: not attached(daemon, t.pid), timeout=30)


def test_an_agent_window_on_a_session_held_without_the_agent_is_refused_in_one_line(daemon, start_target):
    t = start_target("named_loop.py", "held_loop", "0.3")
    assert daemon.cli("attach", str(t.pid)).returncode == 0
    try:
        r = daemon.cli("profile", "--pid", str(t.pid), "--agent", "--duration", "1")
        assert r.returncode != 0
        errors = [line for line in r.stderr.splitlines() if line.startswith("stacklens: error")]
        assert len(errors) == 1 and "without the agent" in errors[0], r.stderr
        assert attached(daemon, t.pid)          # the held session stays as it was
    finally:
        daemon.cli("detach", str(t.pid))


def test_a_target_that_exits_during_the_window_ends_it_at_its_exit(daemon, start_target, tmp_path):
    t = start_target("named_loop.py", "exits_soon", "0.5")
    out = tmp_path / "p.json"
    proc = subprocess.Popen(profile_cmd(daemon, t.pid, "--duration", "60", "--format", "json", "-o", str(out)),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for_line(proc, "collecting for")
        cpu0 = cpu_s(t.pid)
        until("the target ran 0.3 s on CPU in the window", lambda: cpu_s(t.pid) - cpu0 >= 0.3, timeout=120)
        t.kill()
        killed = time.monotonic()
        proc.wait(timeout=120)
        took = time.monotonic() - killed
        rest = rest_of(proc, proc.stderr.read())
        assert took <= 3.0, (took, rest)        # issue 41: within 3 s of the exit
        assert proc.returncode == 0, rest
        assert "exited" in rest and "up to its exit" in rest, rest
        assert export.load(out).meta["window"]["target_exited"]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize("sig,agent", [(signal.SIGTERM, True), (signal.SIGHUP, False), (signal.SIGKILL, True)])
def test_a_window_whose_client_is_killed_leaves_nothing_attached(daemon, start_target, sig, agent):
    t = start_target("named_loop.py", "lease_loop", "0.3")
    proc = subprocess.Popen(profile_cmd(daemon, t.pid, "--duration", "600", *(["--agent"] if agent else [])),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=default_signals)
    try:
        wait_for_line(proc, "collecting for")
        assert attached(daemon, t.pid) and agent_threads(t.pid) == int(agent)
        proc.send_signal(sig)
        proc.wait(timeout=60)
        gone = time.monotonic()
        until("the session let go", lambda: not attached(daemon, t.pid) and agent_threads(t.pid) == 0, timeout=60)
        assert time.monotonic() - gone <= 5.0
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def test_two_windows_at_once_and_an_attach_during_them(daemon, start_target, tmp_path):
    t = start_target("named_loop.py", "shared_loop", "0.5")
    outs = [tmp_path / f"w{i}.json" for i in range(2)]
    # long windows, ended by Ctrl-C once the attach is checked: the attach comes while both hold
    # the session however slowly the CLIs start (15 s windows were over before it on a loaded machine)
    procs = [subprocess.Popen(profile_cmd(daemon, t.pid, "--duration", "3600", "--format", "json", "-o", str(o)),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=default_signals)
             for o in outs]
    try:
        for p in procs:
            try:
                said = "".join(wait_for_line(p, "collecting for"))
            except AssertionError as e:       # where the daemon's threads are, for the report
                raise AssertionError(f"{e}\n{daemon_threads(daemon)}\n{daemon.log.read_text()[-3000:]}") from None
            assert "through stacklensd" in said, said       # a window of the daemon's, not a one-shot
        r = daemon.cli("attach", str(t.pid))
        assert r.returncode == 0 and "held by window" in r.stdout, r.stdout + r.stderr
        held = ps(daemon)[t.pid]["held_by"]
        assert "attach" in held and len([h for h in held if h.startswith("window")]) == 2, (held, r.stdout)
        cpu0 = cpu_s(t.pid)
        until("the target ran 0.2 s on CPU with the attach", lambda: cpu_s(t.pid) - cpu0 >= 0.2, timeout=120)
        for p in procs:
            p.send_signal(signal.SIGINT)        # ends the window now: its profile is written
        for p in procs:
            _, err = p.communicate(timeout=300)
            err = rest_of(p, err)
            assert p.returncode == 0, err
            assert "ending the window now" in err and "ended by its client" in err, err
        for o in outs:
            w = export.load(o).meta["window"]
            assert w["drained"] and w["cpu_samples"] > 0 and w["ended_early"], w
        # the attach outlives the windows
        now = ps(daemon)[t.pid]
        assert now["state"] == "attached" and now["held_by"] == ["attach"], now
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        daemon.cli("detach", str(t.pid))
    until("detached", lambda: not attached(daemon, t.pid), timeout=30)


def test_ending_a_window_that_is_not_open_is_refused_in_one_line(daemon, start_target):
    from stacklens.daemon.client import DaemonClient

    t = start_target("named_loop.py", "idle_target", "0.3")
    with DaemonClient(str(daemon.sock)) as c:
        with pytest.raises(NoSuchProcess, match="no profile window 999999 is open"):
            c._call(c.stub.EndWindow, pb.EndWindowRequest(pid=t.pid, window_id=999999), timeout=30)


def _spawn_with_pid(pid: int) -> subprocess.Popen:
    """A target started as PID `pid` (free now): ns_last_pid set to the one before, as root."""
    for _ in range(50):
        with open("/proc/sys/kernel/ns_last_pid", "w") as f:
            f.write(str(pid - 1))
        p = subprocess.Popen([sys.executable, str(TARGETS / "idle_loop.py")], stdout=subprocess.PIPE, text=True)
        if p.pid == pid:
            return p
        p.kill()
        p.wait()
    pytest.skip(f"could not start a process as PID {pid} (other processes took it first)")


def test_a_reused_pid_ends_the_old_session_and_the_new_process_can_be_attached(daemon):
    old = subprocess.Popen([sys.executable, str(TARGETS / "idle_loop.py")], stdout=subprocess.PIPE, text=True)
    new = None
    try:
        assert old.stdout.readline().strip() == "ready"
        assert daemon.cli("attach", str(old.pid)).returncode == 0
        pid = old.pid
        old.kill()
        old.wait()
        new = _spawn_with_pid(pid)
        assert new.stdout.readline().strip() == "ready"
        r = daemon.cli("attach", str(pid))
        assert r.returncode == 0, r.stderr
        p = ps(daemon)[pid]
        assert p["state"] == "attached" and p["held_by"] == ["attach"], p
    finally:
        for p in (old, new):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()
        daemon.cli("detach", str(old.pid))
