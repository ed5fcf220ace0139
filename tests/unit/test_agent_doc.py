"""docs/agent-in-target.md matches the agent's code: every module the agent imports into a target
is named there, and so is every CUPTI call the collector makes through ctypes."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOC = (ROOT / "docs" / "agent-in-target.md").read_text()


def _agent_imports():
    names = set()
    for f in (ROOT / "inject" / "agent").rglob("*.py"):
        for m in re.finditer(r"^\s*(?:import|from) ([a-z_][a-z0-9_]*)", f.read_text(), re.M):
            names.add(m.group(1))
    return names - {"source"}            # `from source import …` inside a docstring example


def test_every_module_the_agent_imports_is_named_in_the_doc():
    imports = _agent_imports()
    assert {"sys", "gc", "ctypes", "cupti"} <= imports
    missing = sorted(n for n in imports if f"{n}" not in DOC.split("Imports in the target:", 1)[1][:600])
    assert missing == []


def test_every_cupti_entry_point_the_collector_binds_is_in_the_doc():
    code = (ROOT / "inject" / "agent" / "gpu" / "cupti.py").read_text()
    bound = set(re.findall(r'"(cupti[A-Z]\w+)"', code))
    assert "cuptiFinalize" in bound
    assert sorted(n for n in bound if n not in DOC) == []
