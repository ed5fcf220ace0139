"""Whole native stacks of a CPU torch training loop (root + eBPF; issue 30, acceptance 1): CPU
samples under an operator carry their native stack from the operator to the BLAS leaf unbroken.

The frame-pointer walk stopped within 8 frames in every sample (libpython3.11, libtorch_cpu and
MKL are built without frame pointers); samples now carry their registers and stack and are walked
with the libraries' .eh_frame (bpf/unwind.py). Numbers: docs/benchmarks/native-stacks.md."""

from __future__ import annotations

import pytest

from stacklens.bpf import ProbeConfig, ProbeSession
from stacklens.bpf.decode import TRUNCATED
from stacklens.daemon.join.splice import splice

from tests.bpf.conftest import poll_until

pytestmark = pytest.mark.bpf
SAMPLES = 300
UNBROKEN_MIN = 0.95   # issue 30, acceptance 1; measured 99.7-100% (docs/benchmarks/native-stacks.md)


def _under_op(e) -> tuple | None:
    """The joined path's part below the innermost operator frame (None: not under an operator)."""
    if not e.op_path:
        return None
    path = splice(tuple(e.py_stack), tuple(e.py_entries or ()), tuple(e.op_path), tuple(e.native_stack))
    last = max(i for i, f in enumerate(path) if f.kind == "op")
    return path[last + 1:]


def test_cpu_samples_under_an_operator_reach_the_blas_leaf_unbroken(bpf_ok, start_target):
    t = start_target("torch_train.py")
    s = ProbeSession(t.pid, ProbeConfig(cpu_sample_hz=199, gpu=False, cfi_unwind=True))
    s.attach()
    try:
        evs = poll_until(s, lambda evs: sum(e.kind == "cpu_sample" and bool(e.op_path) for e in evs) >= SAMPLES,
                         timeout_s=120)
        skipped = s.stats()["stack_copies_skipped"]
    finally:
        s.detach()
    below = [b for e in evs if e.kind == "cpu_sample" and (b := _under_op(e)) is not None]
    assert len(below) >= SAMPLES, len(below)
    unbroken = [b for b in below if b and TRUNCATED not in b]
    # samples sent without a copy while the ring was 3/4 full (a reader behind on a loaded
    # machine: counted, cpu.bpf.c) are the load shed, not the walk's; at most as many are left out
    assert skipped <= len(below) // 4, (skipped, len(below))
    assert len(unbroken) / (len(below) - skipped) >= UNBROKEN_MIN, (len(unbroken), len(below), skipped)
    # the matrix products' leaves are MKL's kernels, reached through the dispatcher from the op
    blas = [b for b in unbroken if b[-1].name.startswith("mkl_blas")]
    assert blas, "no sample in MKL's sgemm"
    assert all(any(f.name.startswith("at::_ops::") for f in b) for b in blas[:50]), blas[0]


def test_a_reader_that_stalls_sheds_stack_copies_not_samples(bpf_ok, start_target):
    """While three quarters of the ring wait to be read, a sample goes out without its stack copy (the
    program asks the ring at each sample, bpf_ringbuf_query): a reader that stalls for seconds
    loses no sample. Before, a flag the reader set at each poll let a stalled reader's ring fill
    (499 Hz: 240 samples lost in 3 of 3 runs on a loaded VM)."""
    import time

    t = start_target("named_loop.py", "busy_fn")
    # a 4 MiB ring: three quarters of it is ~200 samples with their copy, then ~1,000 without
    s = ProbeSession(t.pid, ProbeConfig(cpu_sample_hz=499, ops=False, gpu=False, ringbuf_pages=1024, cfi_unwind=True))
    s.attach()
    try:
        deadline = time.monotonic() + 60
        while s.stats()["stack_copies_skipped"] < 100:   # nothing read meanwhile: the reader stalls
            assert time.monotonic() < deadline, s.stats()
            time.sleep(0.02)
        taken = s.stats()["samples"]
        evs = poll_until(s, lambda evs: sum(e.kind == "cpu_sample" for e in evs) >= taken, timeout_s=60)
        stats = s.stats()
    finally:
        s.detach()
    assert stats["lost_samples"] == 0 and stats["drops"] == 0, stats
    samples = [e for e in evs if e.kind == "cpu_sample"]
    assert len(samples) >= taken, (len(samples), taken)
    # the ones with their copy were walked whole, the ones without by frame pointers alone
    assert all(e.native_stack for e in samples)
