"""Native stacks through a stripped library (root + eBPF): the library's unnamed internals are
one frame, `libcuda.so.1 [stripped]`, so a steady loop makes a fixed set of stacks however many
call sites and sampled instructions it has (before, each address was a frame of its own and the
profile grew for as long as the loop ran: docs/benchmarks/profile-growth.md)."""

from __future__ import annotations

import pytest

from stacklens.bpf import ProbeConfig, ProbeSession
from stacklens.cct import Frame

from tests.bpf.conftest import FAKES, _cc, poll_until

pytestmark = pytest.mark.bpf
LIB = "libcuda.so.1"
STRIPPED = Frame.native(LIB, "[stripped]")


def test_a_stripped_library_is_one_frame_in_launch_and_sample_stacks(bpf_ok, tmp_path, start_target):
    lib = tmp_path / LIB
    _cc(lib, "-shared", "-s", str(FAKES / "fake_cuda_stripped.c"))
    t = start_target("stripped_loop.py", str(lib))
    s = ProbeSession(t.pid, ProbeConfig(cpu_sample_hz=499))
    s.attach()
    try:
        t.send("run 3")

        def enough(evs):
            return (sum(e.kind == "launch" for e in evs) >= 200
                    and sum(e.kind == "cpu_sample" and STRIPPED in e.native_stack for e in evs) >= 100)

        evs = poll_until(s, enough, timeout_s=15)
        assert t.readline(timeout=30).startswith("done")
    finally:
        s.detach()
    launches = [e for e in evs if e.kind == "launch"]
    samples = [e for e in evs if e.kind == "cpu_sample" and STRIPPED in e.native_stack]
    assert len(launches) >= 200 and len(samples) >= 100, (len(launches), len(samples))

    for e in launches + samples:
        assert not any("0x" in f.name for f in e.native_stack), e.native_stack
        assert all(not (a == b == STRIPPED) for a, b in zip(e.native_stack, e.native_stack[1:])), e.native_stack
    # seven call sites of cuLaunchKernel (six workers, one through a deeper helper): one context
    tails = {e.native_stack[-3:] for e in launches}
    assert tails == {(Frame.native(LIB, "sl_steady_step"), STRIPPED, Frame.native(LIB, "cuLaunchKernel"))}
    assert {e.kernel_name for e in launches} >= {f"unresolved:0x{0x1000 + i * 0x10:x}" for i in range(6)}
    # samples land on hundreds of instructions of the workers: a few contexts
    below = {e.native_stack[e.native_stack.index(Frame.native(LIB, "sl_steady_step")):] for e in samples
             if Frame.native(LIB, "sl_steady_step") in e.native_stack}
    assert below <= {(Frame.native(LIB, "sl_steady_step"), STRIPPED),
                     (Frame.native(LIB, "sl_steady_step"), STRIPPED, Frame.native(LIB, "cuLaunchKernel"))}, below
