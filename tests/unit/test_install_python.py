"""The Python that pyproject.toml declares is the Python the code needs (issue 30.7): the package
runs on 3.10 (its only 3.11 module, tomllib, falls back to the `tomli` dependency there);
scripts/setup.sh needs 3.11 for the test dependencies and says so (tests/unit/test_install_setup.py).

The 3.10 checks run pyenv's 3.10 (tests/interpreters.py) and skip where it is not installed; the
3.10 interpreter gets the `tomli` package as a copy of this interpreter's tomllib (the stdlib took
tomli 2.0 as it was). No privilege."""

from __future__ import annotations

import ast
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from tests.interpreters import pyenv_python

REPO = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
MINIMUM = "3.10.13"
NOT_PACKAGE = ("tests/", "benchmarks/")


def _minimum() -> tuple[int, int]:
    m = re.fullmatch(r">=\s*(\d+)\.(\d+)", PYPROJECT["project"]["requires-python"])
    assert m, f"requires-python {PYPROJECT['project']['requires-python']!r} is not '>=X.Y'"
    return int(m.group(1)), int(m.group(2))


def _package_files() -> list[str]:
    out = subprocess.run(["git", "ls-files", "-z", "*.py"], cwd=REPO, capture_output=True, check=True).stdout
    return [p for p in out.decode().split("\0") if p and not p.startswith(NOT_PACKAGE)]


@pytest.fixture
def python_min() -> str:
    assert MINIMUM.startswith("%d.%d." % _minimum()), "MINIMUM should be a build of requires-python's minimum"
    py = pyenv_python(MINIMUM)
    if not Path(py).exists():
        pytest.skip(f"pyenv's Python {MINIMUM} is not installed (pyenv install {MINIMUM})")
    return py


@pytest.fixture
def tomli_path(tmp_path) -> Path:
    """A directory with `stacklens` (this checkout) and `tomli` (the stdlib's tomllib) in it."""
    (tmp_path / "stacklens").symlink_to(REPO)
    shutil.copytree(Path(tomllib.__file__).parent, tmp_path / "tomli",
                    ignore=shutil.ignore_patterns("__pycache__"))
    return tmp_path


def test_requires_python_is_310_and_tomli_comes_with_it():
    assert _minimum() == (3, 10)
    deps = PYPROJECT["project"]["dependencies"]
    assert any(re.fullmatch(r"tomli>=[\d.]+; python_version < '3\.11'", d) for d in deps), deps


def test_every_tomllib_import_falls_back_to_tomli():
    """tomllib is 3.11's: each import of it sits in a try whose handler imports tomli."""
    bare = []
    for rel in _package_files():
        tree = ast.parse((REPO / rel).read_text(), rel)
        guarded = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Try) and any(
                    isinstance(n, ast.Import) and any(a.name == "tomli" for a in n.names)
                    for h in node.handlers for n in ast.walk(h)):
                guarded |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
        for node in ast.walk(tree):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module] if isinstance(node, ast.ImportFrom) else [])
            if "tomllib" in names and id(node) not in guarded:
                bare.append(f"{rel}:{node.lineno}")
    assert not bare, f"tomllib without the tomli fallback (Python 3.10): {bare}"


def test_every_package_module_compiles_on_the_minimum(python_min):
    code = ("import sys\nbad = []\nfor f in sys.argv[1:]:\n    try:\n        compile(open(f).read(), f, 'exec')\n"
            "    except SyntaxError as e:\n        bad.append(f'{f}:{e.lineno}: {e.msg}')\nprint(bad)\n")
    files = _package_files()
    r = subprocess.run([python_min, "-c", code, *files], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]", f"syntax newer than requires-python's {_minimum()}: {r.stdout}"
    assert len(files) > 100


def test_probe_specs_load_on_the_minimum(python_min, tomli_path):
    """bpf/ (pure Python over ctypes) imports on 3.10 and reads bpf/probes.toml through tomli."""
    code = ("import sys\nassert sys.version_info[:2] == (3, 10), sys.version\n"
            "from stacklens.bpf import spec\nprint(len(spec.load_specs(spec.DEFAULT_SPEC)))\n")
    r = subprocess.run([python_min, "-I", "-c", f"import sys; sys.path.insert(0, {str(tomli_path)!r})\n" + code],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert int(r.stdout) > 10


def test_daemon_config_loads_without_tomllib(tmp_path, tomli_path):
    """What stacklensd does on 3.10: no tomllib, tomli instead (the daemon imports grpc, built for
    this interpreter, so this runs here with tomllib blocked)."""
    bad = tmp_path / "bad.toml"
    bad.write_text("top_k = \n")
    code = (f"import sys; sys.modules['tomllib'] = None; sys.path.insert(0, {str(tomli_path)!r})\n"
            "from stacklens.daemon import server\nfrom stacklens.errors import InputError\n"
            "assert server.tomllib.__name__ == 'tomli', server.tomllib\n"
            f"print(server.load_config({str(REPO / 'systemd' / 'stacklensd.toml')!r}))\n"
            f"try:\n    server.load_config({str(bad)!r})\nexcept InputError as e:\n    print(e)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    shipped, err = r.stdout.splitlines()
    assert shipped == "{'top_k': 10}"
    assert "is not valid TOML" in err
