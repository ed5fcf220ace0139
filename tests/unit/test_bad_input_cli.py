"""Bad input that used to get the wrong answer (issue 26.4), each refused before any work with one
line and a non-zero exit, no traceback, and no work lost: durations, output paths, a PID root
cannot read, a target that exits during the attach or the window (or is measured by nothing),
`report --input F --window`. The one-shot's work is faked (no privilege): `profile_pid` and the
sessions behind it take fake probes. `record`'s program output: tests/bpf/test_bad_input_cli.py.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from stacklens.cct import CCT, Frame, METRICS, export
from stacklens.cli import oneshot
from stacklens.cli.main import _oneshot_output, main
from stacklens.daemon.session import ProcessSession
from stacklens.errors import EXIT_USAGE, IncompleteProfile, InputError, NoSuchProcess, PermissionDenied
from tests.fakes.sources import FakeProbes, exiting_probes
from tests.unit.test_daemon_core_limits import FakeProc, _stat
from tests.unit.test_oneshot import args_for, snap_with


def _refused(capsys, *argv: str, code: int = InputError.exit_code, account: bool = False) -> str:
    """Runs the CLI; the one line it answers with (after a profile's account, with `account`)."""
    rc = main(list(argv))
    out = capsys.readouterr()
    assert rc == code, (rc, out.err)
    assert out.out == "" and "Traceback" not in out.err
    lines = out.err.splitlines()
    errors = [ln for ln in lines if ln.startswith("stacklens: error: ")]
    assert len(errors) == 1 and lines[-1] == errors[0], out.err
    assert account or len(lines) == 1, out.err
    return errors[0]


@pytest.fixture
def no_work(monkeypatch):
    """Any one-shot work fails the test: the input must be refused before it."""
    def work(*a, **k):
        pytest.fail("the bad input was not refused before the work")

    monkeypatch.setattr(oneshot, "profile_pid", work)
    monkeypatch.setattr(oneshot, "record_command", work)


@pytest.fixture
def saved(tmp_path):
    t = CCT(metrics=METRICS)
    t.add((Frame.python("train.py", "step", 3),), "cpu_samples", 7)
    path = tmp_path / "p.json"
    export.save(t.snapshot(meta={"pid": 1}), path, "json")
    return path


@pytest.mark.parametrize("duration", ["0", "-5", "nan", "inf"])
def test_profile_duration_not_above_zero_is_refused_before_the_attach(capsys, no_work, duration):
    line = _refused(capsys, "profile", "--pid", str(os.getpid()), "--duration", duration)
    assert f"--duration {float(duration):g}: give a number of seconds above 0" in line


def test_profile_rate_out_of_range_is_refused_before_the_attach(capsys, no_work):
    assert "1..10000 Hz" in _refused(capsys, "profile", "--pid", str(os.getpid()), "--rate", "0")


@pytest.mark.parametrize("cmd", ["profile", "record"])
def test_output_in_a_missing_directory_is_refused_before_the_work(capsys, no_work, tmp_path, cmd):
    out = tmp_path / "missing" / "p.txt"
    argv = ["profile", "--pid", str(os.getpid())] if cmd == "profile" else ["record"]
    argv += ["-o", str(out)] + (["--", "true"] if cmd == "record" else [])
    line = _refused(capsys, *argv)
    assert f"the directory {out.parent} does not exist" in line


def test_output_that_is_a_directory_is_refused(capsys, no_work, tmp_path):
    assert "that is a directory" in _refused(capsys, "profile", "--pid", str(os.getpid()), "-o", str(tmp_path))


def test_report_output_in_a_missing_directory_is_refused_before_loading(capsys, tmp_path):
    out = tmp_path / "missing" / "r.txt"
    line = _refused(capsys, "report", "--input", str(tmp_path / "nowhere.json"), "-o", str(out))
    assert "does not exist" in line and str(out.parent) in line     # not the missing input: the output first


def test_report_input_with_window_is_refused(capsys, saved):
    line = _refused(capsys, "report", "--input", str(saved), "--window", "10")
    assert "--window applies to a live session" in line and "drop --window" in line


def test_a_profile_whose_output_cannot_be_written_after_all_is_kept(capsys, monkeypatch, tmp_path):
    """The directory checked before the work is gone when the profile is written: the profile is
    saved elsewhere, and the one line says where."""
    outdir = tmp_path / "out"
    outdir.mkdir()

    def profile(pid, **kw):
        outdir.rmdir()
        return snap_with({"target_cpu_s": 1.0}, samples=99)

    monkeypatch.setattr(oneshot, "profile_pid", profile)
    line = _refused(capsys, "profile", "--pid", str(os.getpid()), "-o", str(outdir / "p.txt"), account=True)
    assert f"cannot write {outdir / 'p.txt'}" in line and "the profile is saved in " in line
    kept = line.split("the profile is saved in ", 1)[1].split(":", 1)[0]
    try:
        assert export.load(kept).total("cpu_samples") == 99
    finally:
        os.unlink(kept)


def test_profile_of_a_pid_root_cannot_read_says_why_at_once():
    procfs = FakeProc({(1, "stat"): _stat(1, "init", 0x400100), (1, "cmdline"): "/sbin/init\0",
                       (1, "maps"): PermissionDenied("cannot read /proc/1/maps: run stacklens as root")})
    with pytest.raises(PermissionDenied) as e:
        oneshot.profile_pid(1, duration_s=5, procfs=procfs,
                            session_factory=lambda *a, **k: pytest.fail("must not attach"))
    if os.geteuid() == 0:
        assert "run stacklens as root" not in str(e.value)
        assert "refuses stacklens (root) access to /proc/1/maps" in str(e.value) and "protected" in str(e.value)


def test_profile_of_a_kernel_thread_is_refused_before_the_attach(capsys, monkeypatch):
    monkeypatch.setattr(ProcessSession, "start", lambda *a, **k: pytest.fail("must not attach"))
    assert "is a kernel thread" in _refused(capsys, "profile", "--pid", "2")


def _child() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])


def test_a_target_that_exits_during_the_attach_is_told_so():
    p = _child()
    ExitingProbes = exiting_probes(p)

    try:
        with pytest.raises(NoSuchProcess) as e:
            oneshot.profile_pid(p.pid, duration_s=5, session_factory=lambda pid, **kw: ProcessSession(
                pid, probe_factory=lambda q, **_: ExitingProbes(q), **kw))
        assert str(e.value) == (f"process {p.pid} exited while stacklens was attaching to it (at step "
                                "'compiling BPF'); nothing was left attached and nothing was measured")
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


def test_a_target_that_exits_in_the_window_before_anything_arrived_measured_nothing(capsys):
    """It used to exit 0 with an empty profile and `due ≈None`."""
    p = _child()

    def progress(phase: str) -> None:
        if phase.startswith("collecting"):
            p.kill()
            p.wait()

    try:
        snap = oneshot.profile_pid(p.pid, duration_s=600, progress=progress,   # ends at the exit, not the clock
                                   session_factory=lambda pid, **kw: ProcessSession(
                                       pid, probe_factory=lambda q, **_: FakeProbes(q), **kw))
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert snap.meta["window"]["target_exited"]
    with pytest.raises(IncompleteProfile, match="nothing was measured: the process exited .* before any sample"):
        _oneshot_output(snap, args_for("json"))
    assert capsys.readouterr().out == ""        # nothing written


def test_a_window_with_nothing_and_no_cpu_time_is_an_error_not_due_none(capsys):
    snap = snap_with({"target_cpu_s": None})
    lines, err = oneshot.assess(snap)
    assert isinstance(err, IncompleteProfile) and err.exit_code != 0
    assert "nothing was measured" in str(err) and "CPU time could not be read" in str(err)
    window = next(ln for ln in lines if ln.startswith("window: "))
    assert "due unknown" in window and "None" not in window and "target CPU unknown" in window


def test_a_target_that_exited_in_the_window_with_samples_is_kept_with_a_note():
    lines, err = oneshot.assess(snap_with({"target_cpu_s": None, "target_exited": True}, samples=40))
    assert err is None
    assert any("the process exited 5.0s into the window" in ln for ln in lines)
    assert any("CPU time could not be read after its exit" in ln for ln in lines)


def test_attach_wait_not_above_zero_is_refused(capsys, tmp_path):
    line = _refused(capsys, "--socket", str(tmp_path / "none.sock"), "attach", "123", "--wait", "0")
    assert "--wait 0: give a number of seconds above 0" in line


def test_usage_errors_keep_their_exit_code(capsys):
    assert main(["profile"]) == EXIT_USAGE          # --pid missing: argparse's usage error
    capsys.readouterr()
