"""Stream captures seen by the probes (kind "capture", daemon/join/graphs.py), on the fake libcuda
attached by PID (root + eBPF): the capture's launches are the graph's nodes, with their lines."""

from __future__ import annotations

import pytest

from stacklens.bpf import ProbeConfig, ProbeSession
from stacklens.daemon.join.joiner import Joiner

from tests.bpf.conftest import TARGETS, poll_until

pytestmark = pytest.mark.bpf
N = 4


def test_launches_between_begin_and_end_capture_become_the_graph_s_nodes(bpf_ok, fake_libs, start_target):
    t = start_target("fake_cuda_capture.py", str(fake_libs["dir"]), str(N))
    s = ProbeSession(t.pid, ProbeConfig(cpu_sample_hz=0))
    s.attach()
    try:
        t.send()
        t.readline()
        evs = poll_until(s, lambda e: any(x.kind == "graph" for x in e))
    finally:
        s.detach()
    caps = [e for e in evs if e.kind == "capture"]
    assert [e.api for e in caps] == ["cuStreamBeginCapture", "cuStreamEndCapture"]
    assert all(e.args["stream"] == 0x5151 and e.tid == t.pid for e in caps)
    j = Joiner(t.pid, agent=True)
    for e in sorted(evs, key=lambda e: e.ktime_ns):
        j.on_bpf(e)
    assert not j.graphs.open and len(j.graphs.captures) == 1
    cap = j.graphs.captures[0]
    line = next(i for i, text in enumerate((TARGETS / "fake_cuda_capture.py").read_text().splitlines(), 1)
                if text.rstrip().endswith("# CAPTURED_LINE"))
    assert len(cap.paths) == N
    for p in cap.paths:
        py = [f for f in p if f.kind == "python"]
        assert (py[-1].name, py[-1].line) == ("launch", py[-1].line) and py[-2].line == line
        assert p[-1].name == "node_kernel"
    # the launch before the capture and the graph launch wait for their kernels; the captured
    # launches do not (their kernels run when the graph replays)
    assert j.waiting_launches() == 2
