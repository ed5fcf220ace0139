"""The pure core (cct, analyzer) imports no BPF, UI, RPC, metrics-server or ctypes code."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).parents[2]
FORBIDDEN = ("bcc", "textual", "grpc", "prometheus_client", "ctypes")


def test_core_imports_stay_pure() -> None:
    code = (
        "import sys, stacklens.cct, stacklens.cct.export, stacklens.analyzer\n"
        f"bad = sorted(m for m in sys.modules if m.split('.')[0] in {FORBIDDEN!r})\n"
        "print(','.join(bad))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "", f"the pure core pulled in: {result.stdout.strip()}"


def test_import_linter_contracts() -> None:
    lint = Path(sys.executable).with_name("lint-imports")
    if not lint.exists():
        pytest.skip("import-linter is not installed (pip install -e '.[test]')")
    result = subprocess.run([str(lint)], cwd=REPO, capture_output=True, text=True)
    output = result.stdout + result.stderr
    assert "include_external_packages" not in output, (
        "pyproject.toml [tool.importlinter] needs `include_external_packages = true`: the "
        "contracts forbid external modules (bcc, grpc, ...), which import-linter only tracks then"
    )
    assert result.returncode == 0, output


def test_one_import_style_absolute_from_the_package():
    """`from stacklens.x import y` everywhere (tests: `from tests.x`); relative imports only in
    generated code (protoc's grpc stub) and the target-side scripts under tests/targets."""
    import re

    root = Path(__file__).resolve().parents[2]
    relative = re.compile(r"^\s*from \.+[\w.]* import ", re.M)
    found = [str(p.relative_to(root)) for p in root.rglob("*.py")
             if not {".venv", "targets", "__pycache__"} & set(p.relative_to(root).parts)
             and p.name != "stacklens_pb2_grpc.py" and relative.search(p.read_text(errors="replace"))]
    assert not found, found


def test_the_pure_parts_load_nothing_privileged():
    """cct, analyzer and the join, imported in a fresh interpreter, load no bcc, grpc, textual,
    prometheus_client or ctypes (the contracts check direct imports; this, everything they pull in)."""
    code = ("import sys; import stacklens.cct, stacklens.analyzer, stacklens.daemon.join.joiner; "
            "print(sorted(m for m in ('bcc', 'grpc', 'textual', 'prometheus_client', 'ctypes') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
