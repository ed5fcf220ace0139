"""Whether this process may ptrace, for the tests that inject into targets: probed on a throwaway
child (not read off the euid), so that a test skips with the reason where it cannot run."""

from __future__ import annotations

import ctypes
import subprocess
import sys

import pytest

PTRACE_SEIZE, PTRACE_DETACH = 0x4206, 17


def ptrace_refused() -> str | None:
    """Why this process may not ptrace a child of its own, or None where it may."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.ptrace(PTRACE_SEIZE, child.pid, None, None) != 0:
            return (f"ptrace(PTRACE_SEIZE) refused: errno {ctypes.get_errno()}; "
                    "needs CAP_SYS_PTRACE or ptrace_scope<=1")
        libc.ptrace(PTRACE_DETACH, child.pid, None, None)
        return None
    finally:
        child.kill()
        child.wait()


def skip_module_without_ptrace() -> None:
    """Called at a test module's import: skips that module, and every module importing it, where
    ptrace is refused."""
    why = ptrace_refused()
    if why:
        pytest.skip(why, allow_module_level=True)
