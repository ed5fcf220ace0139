"""scripts/setup.sh touches nothing outside its clone unless asked (issue 30.7): two clones set up
side by side keep their own commands; `--install-links` (or STACKLENS_LINK=1) makes one clone the
machine's (the /usr/local/bin links the systemd unit runs, its config and the docs it names) and
says what each link pointed at before. It tells a Python too old for its test dependencies.

Runs setup.sh's own functions (the script sourced, in bash) on copies of the files it installs,
with fake .venv commands and DESTDIR as the machine's root; no apt, pip or privilege."""

from __future__ import annotations

import importlib.metadata
import re
import shlex
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest

from tests.interpreters import pyenv_python

REPO = Path(__file__).resolve().parents[2]
SETUP = REPO / "scripts" / "setup.sh"
UNIT = REPO / "systemd" / "stacklensd.service"
COMMANDS = ("stacklens", "stacklensd")


def make_clone(root: Path) -> Path:
    """What install_system reads from a clone: the script, the docs, the config, .venv's commands."""
    for rel in ("scripts/setup.sh", "README.md", "systemd/README.md", "systemd/stacklensd.toml"):
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(REPO / rel, root / rel)
    for c in COMMANDS:
        exe = root / ".venv" / "bin" / c
        exe.parent.mkdir(parents=True, exist_ok=True)
        exe.write_text(f"#!/bin/sh\necho {c} of {root.name}\n")
        exe.chmod(0o755)
    return root


def install(clone: Path, dest: Path, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """setup.sh's argument parsing and its install step, as main() runs them, in `clone`."""
    r = subprocess.run(["bash", "-c", 'source scripts/setup.sh && parse_args "$@" && install_system', "_", *args],
                       cwd=clone, capture_output=True, text=True, timeout=60,
                       env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "DESTDIR": str(dest), **(env or {})})
    assert r.returncode == 0, r.stderr
    return r


def links(dest: Path) -> dict[str, str]:
    return {c: str((dest / "usr/local/bin" / c).resolve()) for c in COMMANDS if (dest / "usr/local/bin" / c).is_symlink()}


def test_without_the_flag_nothing_is_written_outside_the_clone(tmp_path):
    a = make_clone(tmp_path / "a")
    dest = tmp_path / "root"
    dest.mkdir()
    r = install(a, dest)
    assert list(dest.iterdir()) == []
    assert "nothing installed outside this clone" in r.stdout
    assert "--install-links" in r.stdout


def test_two_clones_side_by_side(tmp_path):
    a, b = make_clone(tmp_path / "a"), make_clone(tmp_path / "b")
    dest = tmp_path / "root"
    bin_dir = dest / "usr/local/bin"

    r = install(a, dest, "--install-links")
    assert links(dest) == {c: str(a / ".venv/bin" / c) for c in COMMANDS}
    assert f"{bin_dir}/stacklensd -> {a}/.venv/bin/stacklensd" in r.stdout

    # b set up without the flag: a's commands stay, and b is told
    r = install(b, dest)
    assert links(dest) == {c: str(a / ".venv/bin" / c) for c in COMMANDS}
    assert f"links to another clone ({a}/.venv/bin/stacklens)" in r.stdout
    out = subprocess.run([str(bin_dir / "stacklens")], capture_output=True, text=True, check=True).stdout
    assert out == "stacklens of a\n"

    # b asks: the links move, and each line says where they pointed
    r = install(b, dest, env={"STACKLENS_LINK": "1"})
    assert links(dest) == {c: str(b / ".venv/bin" / c) for c in COMMANDS}
    assert f"{bin_dir}/stacklens -> {b}/.venv/bin/stacklens (was -> {a}/.venv/bin/stacklens)" in r.stdout
    # and a second run changes nothing
    assert "(unchanged)" in install(b, dest, "--install-links").stdout


def test_a_file_where_a_link_goes_is_left_alone(tmp_path):
    a = make_clone(tmp_path / "a")
    dest = tmp_path / "root"
    (dest / "usr/local/bin").mkdir(parents=True)
    (dest / "usr/local/bin/stacklens").write_text("someone's own\n")
    r = subprocess.run(["bash", "-c", 'source scripts/setup.sh && parse_args "$@" && install_system', "_",
                        "--install-links"], cwd=a, capture_output=True, text=True, timeout=60,
                       env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "DESTDIR": str(dest)})
    assert r.returncode != 0
    assert "is not a link: left as it is" in r.stderr
    assert (dest / "usr/local/bin/stacklens").read_text() == "someone's own\n"


def _unit(key: str) -> list[str]:
    return [line.split("=", 1)[1] for line in UNIT.read_text().splitlines() if line.startswith(key + "=")]


def test_the_install_puts_there_what_the_unit_names(tmp_path):
    """ExecStart's binary, its --config and every Documentation= file exist after --install-links."""
    a = make_clone(tmp_path / "a")
    dest = tmp_path / "root"
    install(a, dest, "--install-links")
    argv = shlex.split(_unit("ExecStart")[0])
    assert (dest / argv[0].lstrip("/")).resolve() == a / ".venv/bin/stacklensd"
    config = argv[argv.index("--config") + 1]
    assert (dest / config.lstrip("/")).read_text() == (REPO / "systemd/stacklensd.toml").read_text()
    docs = [d for line in _unit("Documentation") for d in line.split()]
    assert docs and all(d.startswith("file:/") for d in docs), docs
    for d in docs:
        assert (dest / d.removeprefix("file:/")).is_file(), f"{d}: the unit names it, setup.sh does not install it"
    assert (dest / "usr/share/doc/stacklens/README.md").read_text() == (REPO / "README.md").read_text()


def _setup_min() -> str:
    m = re.search(r"^SETUP_MIN_PYTHON=(\d+\.\d+)$", SETUP.read_text(), re.M)
    assert m
    return m.group(1)


def test_setup_minimum_is_what_the_test_dependencies_need():
    """setup.sh asks for the newest Requires-Python among the test extras it installs."""
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    need = []
    for req in pyproject["project"]["optional-dependencies"]["test"]:
        name = re.match(r"[A-Za-z0-9_.-]+", req).group(0)
        spec = importlib.metadata.metadata(name).get("Requires-Python") or ""
        m = re.search(r">=\s*(\d+)\.(\d+)", spec)
        if m:
            need.append((int(m.group(1)), int(m.group(2))))
    assert "%d.%d" % max(need) == _setup_min()


def _pick(env: dict) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-c", "source scripts/setup.sh && pick_python"], cwd=REPO,
                          capture_output=True, text=True, timeout=60, env=env)


@pytest.fixture
def python310() -> str:
    py = pyenv_python("3.10.13")
    if not Path(py).exists():
        pytest.skip("pyenv's Python 3.10.13 is not installed")
    return py


def test_python_310_named_by_the_user_gets_a_clear_message(python310):
    r = _pick({"PATH": "/usr/bin:/bin", "PYTHON": python310})
    assert r.returncode == 1 and r.stdout == ""
    assert f"PYTHON={python310} is Python 3.10; this set-up needs >= {_setup_min()}" in r.stderr
    assert "pip install . (Python >= 3.10)" in r.stderr


def test_python3_310_on_path_falls_back_to_debians(tmp_path, python310):
    debian = subprocess.run(["/usr/bin/python3", "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
                            capture_output=True, text=True).stdout.strip() if Path("/usr/bin/python3").exists() else ""
    if not debian or tuple(map(int, debian.split("."))) < tuple(map(int, _setup_min().split("."))):
        pytest.skip(f"/usr/bin/python3 is {debian or 'missing'}, not Debian 12's 3.11")
    (tmp_path / "python3").symlink_to(python310)
    r = _pick({"PATH": f"{tmp_path}:/usr/bin:/bin"})
    assert r.returncode == 0 and r.stdout == "/usr/bin/python3\n"
    assert f"python3 on PATH is 3.10; this set-up needs >= {_setup_min()}: using /usr/bin/python3 ({debian})" in r.stderr
