"""Paper cuts a new user hit (issue 45), each with the test that failed before its fix."""

from __future__ import annotations

import subprocess
import sys

import pytest

from stacklens.analyzer import analyze
from stacklens.cct import CCT, METRICS, Frame
from stacklens.cct.metrics import fmt_evidence
from stacklens.errors import NoSuchProcess


def test_evidence_reads_in_units_never_in_exponent_notation():
    assert fmt_evidence("wall_ns", 7.60606e9) == "7.61s"
    assert fmt_evidence("wait_share", 0.0468) == "4.7%"
    assert fmt_evidence("kernels", 515356.0) == "515356"
    assert fmt_evidence("copy_bytes", 3 << 20) == "3.0MiB"
    assert fmt_evidence("speedup", 1.8312) == "1.831"
    assert "e+" not in fmt_evidence("launches", 1.5e10)


def test_only_one_finding_may_say_start_here():
    """Two hotspot findings (CPU and GPU, two lines) used to both begin with "Start here"."""
    t = CCT(METRICS)
    a = (Frame.python("/srv/train.py", "step", 10),)
    b = (Frame.python("/srv/train.py", "step", 20),)
    t.add(a, "cpu_samples", 900)
    t.add(b + (Frame.kernel("gemm"),), "gpu_time_ns", 9_000_000_000)
    t.add(b + (Frame.kernel("gemm"),), "kernel_count", 10)
    snap = t.snapshot({"duration_s": 10.0, "cpu_hz": 99})
    fixes = [f.fix for f in analyze(snap)]
    assert len(fixes) >= 2 and sum(x.startswith("Start here") for x in fixes) <= 1, fixes


class _Client:
    def processes(self):
        return []


def test_top_on_a_pid_that_is_neither_running_nor_known_fails_before_the_ui():
    from stacklens.tui.source import DaemonProcesses

    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()                                    # an exited process: its PID is free now
    procs = DaemonProcesses(_Client())
    with pytest.raises(NoSuchProcess, match=f"no process {p.pid}"):
        procs.check_known(p.pid)
    procs.check_known(1)                        # a running process: the UI opens


def test_dump_job_on_a_pid_with_no_ranks_below_is_an_input_error(capsys):
    """It printed a note and exited 0."""
    from stacklens.cli.dump import run_dump
    from stacklens.errors import InputError

    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        with pytest.raises(InputError, match=f"no process under PID {p.pid} sets RANK"):
            run_dump(p.pid, job=True, as_json=False)
        assert capsys.readouterr().out == ""
    finally:
        p.kill()
        p.wait()


def test_output_does_not_follow_a_link_another_user_planted(tmp_path):
    """As root, `-o /tmp/x` followed a link another user had put there (issue 45)."""
    import os

    from stacklens.cli.main import open_output
    from stacklens.errors import InputError

    if os.geteuid() != 0:
        pytest.skip("giving a link to another user needs root (the case is root's: the daemon's CLI)")
    victim = tmp_path / "victim"
    victim.write_text("keep")
    planted = tmp_path / "profile.json"
    planted.symlink_to(victim)
    os.lchown(planted, 12345, 12345)              # another user's link
    with pytest.raises(InputError, match="owned by another user"):
        open_output(str(planted), binary=False)
    assert victim.read_text() == "keep"
    mine = tmp_path / "mine.json"
    mine.symlink_to(tmp_path / "target.json")     # our own link is followed
    with open_output(str(mine), binary=False) as fh:
        fh.write("{}")
    assert (tmp_path / "target.json").read_text() == "{}"


def _kernel_thread() -> int | None:
    from stacklens.introspect.procfs import ProcFS

    procfs = ProcFS()
    for pid in procfs.pids():
        try:
            fields = procfs.stat(pid)[1]
        except Exception:  # noqa: BLE001 — gone meanwhile
            continue
        if len(fields) > 6 and fields[6].isdigit() and int(fields[6]) & 0x00200000:
            return pid
    return None


def test_dump_of_a_kernel_thread_says_so():
    """It said the process "does not exist"."""
    from stacklens.cli.dump import run_dump
    from stacklens.errors import InputError

    kt = _kernel_thread()
    if kt is None:
        pytest.skip("no kernel thread visible in this PID namespace")
    with pytest.raises(InputError, match="is a kernel thread"):
        run_dump(kt, job=False, as_json=False)


def test_root_refused_memory_access_is_not_told_to_run_as_root(monkeypatch):
    """As root, a protected process's /proc/PID/mem said "run as root"."""
    import os

    from stacklens.errors import PermissionDenied
    from stacklens.introspect.procfs import ProcFS

    def refuse(*_a, **_k):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(os, "open", refuse)
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    with pytest.raises(PermissionDenied) as e:
        ProcFS().open_mem(os.getpid())
    assert "run as root" not in str(e.value) and "protected" in str(e.value)
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(PermissionDenied, match="run as root"):
        ProcFS().open_mem(os.getpid())


def test_a_socket_or_token_of_another_user_is_not_trusted(tmp_path):
    """The CLI used a socket and token that a non-root user owned (issue 45)."""
    import os
    import socket as socketlib

    from stacklens.daemon.client import DaemonClient
    from stacklens.errors import PermissionDenied

    if os.geteuid() != 0:
        pytest.skip("giving files to another user needs root")
    sock = tmp_path / "s.sock"
    srv = socketlib.socket(socketlib.AF_UNIX)
    srv.bind(str(sock))
    try:
        os.lchown(sock, 12345, 12345)
        with pytest.raises(PermissionDenied, match="belongs to uid 12345"):
            DaemonClient(str(sock), token="t")
        os.lchown(sock, 0, 0)
        DaemonClient(str(sock), token="t").close()      # root's own: trusted (no call made)
    finally:
        srv.close()


def test_profile_says_when_it_does_not_go_through_a_daemon_that_is_there(tmp_path):
    """A stacklensd socket that does not answer: the default one is skipped with a line saying
    so (it was silent); one the user named is an error (it fell back to compiling here)."""
    import socket as socketlib

    from stacklens.cli.main import _running_daemon
    from stacklens.errors import DaemonUnavailable

    sock = tmp_path / "s.sock"
    srv = socketlib.socket(socketlib.AF_UNIX)
    srv.bind(str(sock))                             # there, but no stacklensd behind it (no token)
    try:
        said: list[str] = []
        assert _running_daemon(str(sock), say=said.append) is None
        assert len(said) == 1 and "did not answer" in said[0] and "profiling without it" in said[0]
        with pytest.raises(DaemonUnavailable, match="--no-daemon"):
            _running_daemon(str(sock), named=True)
    finally:
        srv.close()
