"""Issue 6, acceptance 6: `stacklens demo` (the README's main command) works after set-up:
it starts the bundled PyTorch workload, attaches by PID and shows the live tree."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytestmark = [pytest.mark.bpf, pytest.mark.integration]


def test_demo_shows_the_workloads_python_and_operators(bpf_ok):
    exe = shutil.which("stacklens", path=str(Path(sys.executable).parent)) or shutil.which("stacklens")
    cmd = [exe] if exe else [sys.executable, "-m", "stacklens.cli.main"]
    r = subprocess.run(cmd + ["demo", "--duration", "6", "--plain"], capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stderr[-3000:]
    out = r.stdout
    assert "attached in" in out, out[-3000:]
    assert "train_step" in out, out[-3000:]          # the workload's hot Python function
    assert "aten::" in out, out[-3000:]              # and the operators under it
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
