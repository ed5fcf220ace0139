"""The target's working directory in the session's meta (daemon/session.py process_cwd, read once
at attach) and `line` labels relative to it (daemon/prom.py roots_of)."""

from __future__ import annotations

import os
import time

from stacklens.cct import CCT, Frame
from stacklens.daemon.join.joiner import DAEMON_METRICS
from stacklens.daemon.prom import context_values
from stacklens.daemon.session import ProcessSession, process_cwd
from stacklens.introspect.procfs import ProcFS
from tests.fakes.sources import FakeEvent, FakeProbes


def fake_proc(tmp_path, pid: int, cwd: str | None, root: str = "/") -> ProcFS:
    d = tmp_path / str(pid)
    d.mkdir(parents=True)
    if cwd is not None:
        os.symlink(cwd, d / "cwd")
    os.symlink(root, d / "root")
    return ProcFS(tmp_path)


def test_process_cwd_as_the_target_names_it(tmp_path):
    assert process_cwd(1, fake_proc(tmp_path / "a", 1, "/srv/proj")) == "/srv/proj"
    # chrooted at /jail in the daemon's mount namespace: the target's own paths start at /jail
    assert process_cwd(2, fake_proc(tmp_path / "b", 2, "/jail/srv/proj", root="/jail")) == "/srv/proj"
    assert process_cwd(3, fake_proc(tmp_path / "c", 3, "/jail", root="/jail/")) == "/"
    assert process_cwd(4, fake_proc(tmp_path / "d", 4, "/srv/gone (deleted)")) is None
    assert process_cwd(5, fake_proc(tmp_path / "e", 5, None)) is None      # unreadable: no key
    assert process_cwd(6, fake_proc(tmp_path / "f", 6, "/srv/a\x1bb")) == "/srv/a\\x1bb"   # escaped


def test_session_meta_has_the_cwd_and_lines_are_relative_to_it():
    probes = FakeProbes(os.getpid())
    s = ProcessSession(os.getpid(), probe_factory=lambda pid, **_: probes)
    s.start()
    try:
        under = os.path.join(os.getcwd(), "pkg", "train.py")
        probes.push(FakeEvent("cpu_sample", py_stack=(Frame.python(under, "step", 42),)))
        deadline = time.monotonic() + 10
        snap = s.snapshot()
        while not context_values(snap, "cpu_samples") and time.monotonic() < deadline:
            time.sleep(0.05)
            snap = s.snapshot()
    finally:
        s.stop()
    assert snap.meta["cwd"] == os.getcwd()
    assert [line for _, line in context_values(snap, "cpu_samples")] == ["pkg/train.py:42"]


def test_line_relative_to_the_cwd_only_for_files_under_it():
    t = CCT(metrics=DAEMON_METRICS, max_nodes=None)
    t.add_many((Frame.python("/srv/proj/models/net.py", "forward", 17),), {"cpu_samples": 3})
    t.add_many((Frame.python("/srv/projector/x.py", "f", 2),), {"cpu_samples": 1})     # a sibling, not under
    t.add_many((Frame.python("/usr/lib/python3.11/site-packages/torch/nn/functional.py", "relu", 9),),
               {"cpu_samples": 1})
    # a virtualenv inside the project: its packages are named from site-packages all the same
    t.add_many((Frame.python("/srv/proj/.venv/lib/python3.11/site-packages/numpy/core/x.py", "g", 5),),
               {"cpu_samples": 1})
    lines = {line for _, line in context_values(t.snapshot(meta={"cwd": "/srv/proj"}), "cpu_samples")}
    assert lines == {"models/net.py:17", "projector/x.py:2", "site-packages/torch/nn/functional.py:9",
                     "site-packages/numpy/core/x.py:5"}
    # no cwd (unreadable), or `/`: the last two components
    for meta in ({}, {"cwd": "/"}):
        lines = {line for _, line in context_values(t.snapshot(meta=meta), "cpu_samples")}
        assert "models/net.py:17" in lines and "srv/proj" not in " ".join(lines)
