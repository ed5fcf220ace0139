"""The eBPF tier's capability probe fails the run, not skips it, when a BPF program does not load
under root with BCC installed (issue 40, point 3): a BCC regression must show as a failure.
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import BPF_PROBE_ENV, BpfTierBroken, bpf_tier_skip_reason

REPO = Path(__file__).resolve().parents[2]
BROKEN = "int sl_cap_probe(void *ctx) { return 0 }"   # no ';': clang refuses it


def test_a_uprobe_counts_the_getpid_calls_made(bpf_available) -> None:
    """The tier's own probe at work: a uprobe on libc's getpid counts the calls this test makes
    (the test below runs this one with a broken probe program)."""
    from bcc import BPF

    b = BPF(text=b"""BPF_ARRAY(hits, u64, 1);
int on_getpid(void *ctx) { int k = 0; u64 *v = hits.lookup(&k); if (v) __sync_fetch_and_add(v, 1); return 0; }""")
    try:
        b.attach_uprobe(name=b"c", sym=b"getpid", fn_name=b"on_getpid", pid=os.getpid())
        libc = ctypes.CDLL(None)
        for _ in range(50):
            libc.getpid()   # through libc's symbol (os.getpid may be cached or inlined elsewhere)
        assert b[b"hits"][ctypes.c_int(0)].value >= 50
    finally:
        b.cleanup()


def test_a_program_that_does_not_compile_raises_with_the_loaders_error() -> None:
    if bpf_tier_skip_reason() is not None:
        pytest.skip(bpf_tier_skip_reason())
    with pytest.raises(BpfTierBroken, match="did not load"):
        bpf_tier_skip_reason(BROKEN)


@pytest.mark.timeout(300)
def test_a_broken_probe_program_fails_the_tier_instead_of_skipping_it() -> None:
    if bpf_tier_skip_reason() is not None:
        pytest.skip(bpf_tier_skip_reason())
    r = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rA",
         f"{Path(__file__)}::test_a_uprobe_counts_the_getpid_calls_made"],
        cwd=REPO, capture_output=True, text=True, timeout=280, env=dict(os.environ, **{BPF_PROBE_ENV: BROKEN}))
    out = r.stdout + r.stderr
    assert r.returncode == 1, out          # failed: not 0 (passed or all skipped), not 5 (none collected)
    assert "1 error" in out and "skipped" not in out, out
    assert "did not load and attach" in out and "error:" in out, out   # clang's own diagnostic, passed on
