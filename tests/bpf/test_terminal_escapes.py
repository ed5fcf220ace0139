"""Target strings reach no terminal raw (issue 17 point 9): a target's comm and code-object names
carrying ANSI/OSC sequences come out escaped (``\\x1b``) in what `stacklens ps` lists (discovery),
the session (comm), the `report` text and the Prometheus labels. Real BPF: the code names are
read from the target's memory by the Python stack symbolizer (pystacks/pysym.py).
"""

from __future__ import annotations

import time

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from stacklens.daemon.discovery import describe_process
from stacklens.daemon.prom import Source, StacklensCollector
from stacklens.daemon.session import ProcessSession
from stacklens.render.textreport import render_report

pytestmark = pytest.mark.bpf

COMM = "ev\\x1b[2Jil"
FUNC = "spin\\x1b]0;pwned\\x07"


def test_escapes_in_comm_and_code_names_are_escaped_everywhere(bpf_ok, start_target):
    t = start_target("ansi_names.py")
    assert describe_process(t.pid).comm == COMM              # `stacklens ps`
    s = ProcessSession(t.pid, agent=False, cpu_hz=199, ops=False)
    s.start()
    try:
        assert s.comm == COMM
        end = time.monotonic() + 120             # bounds a broken run; the loop waits for the frame
        while True:
            snap = s.snapshot()
            if any(p[-1].name == FUNC for p, _ in snap.iter_paths() if p and p[-1].kind == "python"):
                break
            assert time.monotonic() < end, "no CPU sample in the target's function"
            time.sleep(0.1)
        report = render_report(snap, "cpu_samples", min_share=0.0)
        assert FUNC in report and f"comm={COMM}" in report
        reg = CollectorRegistry()
        reg.register(StacklensCollector(lambda: [Source(t.pid, s.comm, "", snap, {}, cpu_hz=s.cpu_hz)], hotspots=True))
        metrics = generate_latest(reg).decode()
        assert f'comm="{COMM.replace(chr(92), chr(92) * 2)}"' in metrics   # the exposition escapes '\'
        assert "spin\\\\x1b]0;pwned\\\\x07" in metrics
        for text in (report, metrics, describe_process(t.pid).comm):
            assert "\x1b" not in text and "\x07" not in text
    finally:
        s.stop()
