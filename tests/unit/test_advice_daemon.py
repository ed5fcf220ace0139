"""`stacklens advise PID` through a real stacklensd gRPC server gives what `analyze()` gives on the
snapshot the daemon returns for that PID (issue 23, acceptance 4), on recorded GPU profiles.

Why it once said "no findings": the wheel lacked stacklens.analyzer.rules (pyproject's package
list), so the daemon's analyzer import failed and GetAdvice answered with nothing.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from stacklens.analyzer import analyze
from stacklens.daemon.client import DaemonClient
from stacklens.errors import StacklensError
from tests.grpc_daemon import RecordedSession

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "tests" / "data"
SCENARIOS = ("gpu_kernel_fusion", "gpu_fp32_gemm", "gpu_item_sync", "gpu_h2d_copies")
PROFILE: dict[int, Path] = {}


@pytest.fixture
def session_factory():
    """Sessions serving the profile the test put in PROFILE for their PID."""
    return lambda pid, **kw: RecordedSession(pid, PROFILE[pid], f"serving {PROFILE[pid].parent.name}", **kw)


def _key(f) -> tuple:
    ev = f.evidence.items() if isinstance(f.evidence, dict) else ((e.metric, e.value) for e in f.evidence)
    saving = getattr(f, "estimated_saving_share", None)
    return (f.rule, str(f.severity), tuple(f.path), f.title, f.fix,
            round(float(f.estimated_saving if saving is None else saving), 6),
            tuple(sorted((k, round(float(v), 6)) for k, v in ev)))


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_advise_pid_is_analyze_of_the_pid_s_snapshot(daemon, target, scenario):
    PROFILE[target] = DATA / scenario / "problem.json"
    with DaemonClient(str(daemon.socket_path)) as c:
        c.attach(target)
        snap = c.snapshot(target)          # what `stacklens report PID --format json` writes
        advice = c.advice(target)          # what `stacklens advise PID` prints
    want = analyze(snap)
    assert want, f"{scenario}: the recorded problem has findings"
    assert [_key(f) for f in advice] == [_key(f) for f in want]


def test_advise_without_an_analyzer_is_an_error_not_no_findings(daemon, target, monkeypatch):
    PROFILE[target] = DATA / "gpu_kernel_fusion" / "problem.json"
    monkeypatch.setattr(daemon.servicer, "advisor", None)
    monkeypatch.setitem(sys.modules, "stacklens.analyzer", None)  # import fails as in the bad wheel
    with DaemonClient(str(daemon.socket_path)) as c:
        c.attach(target)
        with pytest.raises(StacklensError, match="cannot load its analyzer.*reinstall"):
            c.advice(target)


def test_every_package_of_the_tree_is_in_the_wheel_list():
    """pyproject lists packages explicitly (the root is the package): a package left out is
    missing from every installed copy but still imports from a checkout."""
    listed = set(re.findall(r'"(stacklens(?:\.\w+)*)"', (ROOT / "pyproject.toml").read_text().split("[tool.setuptools]")[1]
                            .split("[tool.setuptools.package-dir]")[0]))
    found = {"stacklens" + "".join("." + p for p in d.relative_to(ROOT).parts)
             for d in (f.parent for f in ROOT.rglob("__init__.py"))
             if not {"tests", "benchmarks", "build", ".venv"} & set(d.relative_to(ROOT).parts[:1])}
    assert found - listed == set(), "add these to [tool.setuptools] packages in pyproject.toml"
