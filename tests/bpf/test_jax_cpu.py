"""Issue 10, acceptance 3: on a machine without a GPU the JAX path degrades cleanly.

A jitted JAX step running on CPU, profiled by PID with probes + agent (`stacklens profile --agent`
does the same): CPU samples carry the step's Python frames and XLA's native frames, the agent says
that kernel attribution needs a GPU, and GPU metrics are reported unavailable (never zero).
"""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("jax")

from stacklens.cli.oneshot import profile_pid  # noqa: E402

TARGETS = Path(__file__).resolve().parents[1] / "targets"
pytestmark = [pytest.mark.bpf, pytest.mark.integration]


def test_jax_on_cpu_profile_has_python_and_xla_frames_and_says_gpu_is_needed(bpf_ok):
    p = subprocess.Popen([sys.executable, str(TARGETS / "jax_step.py")], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "ready", p.stderr.read() if p.poll() is not None else ""
        snap = profile_pid(p.pid, duration_s=6.0, agent=True)
    finally:
        p.send_signal(signal.SIGTERM)
        out, err = p.communicate(timeout=60)
    assert p.returncode == 0, err[-2000:]
    assert "steps=" in out

    paths = [(tuple(f.label() for f in path), m["cpu_samples"]) for path, m in snap.iter_paths()
             if m.get("cpu_samples")]
    assert paths, "no CPU samples"
    step_file = str(TARGETS / "jax_step.py")
    py_paths = [labels for labels, _ in paths if any(step_file in l for l in labels)]
    def xla(label: str) -> bool:  # a native frame in one of jaxlib's libraries (libjax_common.so, _jax.so, …)
        lib = label.split(":", 2)[1] if label.startswith("native:") else ""
        return "jax" in lib or "xla" in lib.lower()

    xla_paths = [labels for labels, _ in paths if any(xla(l) for l in labels)]
    assert py_paths, "no CPU sample with the step's Python frames"
    assert xla_paths, "no CPU sample with XLA/jaxlib native frames"
    # Python frames of the step, then jaxlib's native frames below them, on one path
    assert any(any(xla(l) for l in labels) for labels in py_paths), py_paths[:3]
    notes = " ".join(snap.meta.get("notes", []))
    assert "GPU" in notes and "kernel attribution" in notes, notes
    assert {"gpu_time_ns", "kernel_count"} <= set(snap.unavailable)
