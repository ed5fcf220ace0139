"""Shared fixtures: tier markers by folder, and capability probes for root-only tiers."""

from __future__ import annotations

import pathlib

import pytest

TESTS = pathlib.Path(__file__).parent


def pytest_collection_modifyitems(config, items):
    for item in items:
        parts = pathlib.Path(str(item.fspath)).relative_to(TESTS).parts
        tier = parts[0] if len(parts) > 1 else "unit"
        if tier in ("integration", "bpf", "gpu"):
            item.add_marker(getattr(pytest.mark, tier))


@pytest.fixture(scope="session")
def bpf_available() -> None:
    """Skip (with the reason) unless a trivial BPF program loads and a uprobe attaches here."""
    try:
        from bcc import BPF

        b = BPF(text="int sl_cap_probe(void *ctx) { return 0; }")
        b.attach_uprobe(name="c", sym="getpid", fn_name="sl_cap_probe")
        b.cleanup()
    except Exception as e:  # noqa: BLE001 — any failure means this machine can't run the tier
        pytest.skip(f"BPF unavailable here ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); "
                    "needs root, BCC and kernel headers (bash scripts/setup.sh)")


@pytest.fixture(scope="session")
def ptrace_available() -> None:
    """Skip unless this process may ptrace a throwaway child."""
    import subprocess
    import sys

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        PTRACE_SEIZE, PTRACE_DETACH = 0x4206, 17
        if libc.ptrace(PTRACE_SEIZE, child.pid, None, None) != 0:
            pytest.skip(f"ptrace not permitted here (errno {ctypes.get_errno()}); needs CAP_SYS_PTRACE or ptrace_scope<=1")
        libc.ptrace(PTRACE_DETACH, child.pid, None, None)
    finally:
        child.kill()
        child.wait()
