"""A real target whose code object has a cut line table: the session reads it, counts it, goes on.

Root (BPF). tests/targets/cut_linetable.py swaps its hot function's location table for one cut
inside an entry; before issue 26 the first sample through it raised IndexError out of poll().
Waits on events (poll_until's predicate), bounded generously for a loaded 2-vCPU machine.
"""

from __future__ import annotations

import sys

import pytest

from tests.bpf.conftest import poll_until

pytestmark = pytest.mark.bpf


@pytest.mark.skipif(sys.version_info < (3, 11), reason="3.11+ location tables")
def test_a_cut_line_table_is_counted_and_the_session_goes_on(bpf_ok, start_target):
    from stacklens.bpf import ProbeConfig, ProbeSession

    t = start_target("cut_linetable.py")
    s = ProbeSession(t.pid, ProbeConfig(cpu_sample_hz=99, ops=False, gpu=False))
    s.attach()
    try:
        def in_hot(ev) -> bool:
            return any(f.name == "hot" for f in ev.py_stack)

        evs = poll_until(s, lambda evs: sum(map(in_hot, evs)) >= 20, timeout_s=120)
        hot = [f for ev in evs if in_hot(ev) for f in ev.py_stack if f.name == "hot"]
        assert len(hot) >= 20, f"{len(evs)} events, {len(hot)} in hot: {s.stats()}"
        first = hot[0]
        # the function is named, at its first line (its table tells no other)
        assert first.kind == "python" and first.file.endswith("cut_linetable.py")
        assert {f.line for f in hot} == {first.line}
        st = s.stats()
        assert st["py_bad_linetables"] >= 1 and st["py_stacks_undecodable"] == 0, st
        assert any("line table(s) not decodable" in n for n in s.read_notes())
        # and the session still decodes what comes next
        assert poll_until(s, lambda evs: any(map(in_hot, evs)), timeout_s=60)
    finally:
        s.detach()
