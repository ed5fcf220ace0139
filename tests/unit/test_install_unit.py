"""What systemd/stacklensd.service lets the daemon write (issue 30.7): the op-symbol cache
(bpf/ops.py) lands in a directory the unit's sandbox leaves writable, not in root's home, which
ProtectHome makes read-only. The sandbox is read from the unit's own lines (ProtectSystem=strict:
only ReadWritePaths=, the *Directory= settings and a private /tmp are writable). No privilege,
no running systemd; `systemd-analyze verify` is tests/integration/test_systemd_units.py's."""

from __future__ import annotations

import glob
import importlib.util
import os
from pathlib import PurePosixPath

import pytest

from stacklens.bpf import ops

from tests.unit.test_install_setup import UNIT

# the *Directory= settings and where systemd puts them for a system service (systemd.exec(5))
DIRECTORY_BASES = {"RuntimeDirectory": "/run", "StateDirectory": "/var/lib", "CacheDirectory": "/var/cache",
                   "LogsDirectory": "/var/log"}
HOMES = ("/root", "/home", "/run/user")


def unit_settings() -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for line in UNIT.read_text().splitlines():
        if "=" in line and not line.startswith(("#", "[")):
            key, value = line.split("=", 1)
            out.setdefault(key, []).append(value)
    return out


def writable_paths(unit: dict[str, list[str]]) -> list[PurePosixPath]:
    assert unit["ProtectSystem"] == ["strict"], "this check models ProtectSystem=strict"
    out = [PurePosixPath(p.lstrip("-+")) for v in unit.get("ReadWritePaths", []) for p in v.split()]
    for key, base in DIRECTORY_BASES.items():
        out += [PurePosixPath(base, d) for v in unit.get(key, []) for d in v.split()]
    if unit.get("PrivateTmp") == ["yes"]:
        out += [PurePosixPath("/tmp"), PurePosixPath("/var/tmp")]
    return out


def writable_under_unit(path: PurePosixPath, unit: dict[str, list[str]]) -> bool:
    """Inside a writable path, and not in a home while ProtectHome= is on (the unit names no
    writable path in a home)."""
    if unit.get("ProtectHome", ["no"]) != ["no"] and any(_inside(path, h) for h in HOMES):
        return False
    return any(_inside(path, w) for w in writable_paths(unit))


def _inside(path: PurePosixPath, d: str | PurePosixPath) -> bool:
    return path == PurePosixPath(d) or PurePosixPath(d) in path.parents


def unit_environment(unit: dict[str, list[str]]) -> dict[str, str]:
    """What systemd sets for the service: HOME of User=, $CACHE_DIRECTORY for CacheDirectory=."""
    env = {"HOME": "/root" if unit.get("User") == ["root"] else "/nonexistent"}
    caches = [str(PurePosixPath("/var/cache", d)) for v in unit.get("CacheDirectory", []) for d in v.split()]
    if caches:
        env["CACHE_DIRECTORY"] = ":".join(caches)
    return env


@pytest.fixture
def as_the_unit(monkeypatch) -> dict[str, list[str]]:
    unit = unit_settings()
    for k in ("XDG_CACHE_HOME", "CACHE_DIRECTORY"):
        monkeypatch.delenv(k, raising=False)
    for k, v in unit_environment(unit).items():
        monkeypatch.setenv(k, v)
    return unit


def test_the_check_sees_the_read_only_home():
    unit = unit_settings()
    home = unit_environment(unit)["HOME"]   # root's: ProtectHome makes it read-only
    assert not writable_under_unit(PurePosixPath(home, ".cache", "stacklens"), unit)
    assert not writable_under_unit(PurePosixPath("/usr/local/share/stacklens"), unit)
    assert writable_under_unit(PurePosixPath("/var/lib/stacklens/x"), unit)


def test_op_symbol_cache_is_writable_under_the_unit(as_the_unit):
    cache = PurePosixPath(ops._cache_dir())
    assert cache == PurePosixPath("/var/cache/stacklens")
    assert writable_under_unit(cache, as_the_unit), f"{cache} is read-only under {UNIT.name}"


def test_op_symbol_cache_is_written_in_cache_directory(tmp_path, monkeypatch):
    spec = importlib.util.find_spec("torch")  # located, not imported
    libs = glob.glob(os.path.join(os.path.dirname(spec.origin), "lib", "libtorch_cpu.so*")) if spec else []
    if not libs:
        pytest.skip("torch with libtorch_cpu.so is not installed (scripts/setup.sh installs it)")
    monkeypatch.setenv("CACHE_DIRECTORY", str(tmp_path))
    monkeypatch.setattr(ops, "_MEMO", {})
    found = ops.find_op_symbols(libs[0])
    st = os.stat(libs[0])
    assert (tmp_path / f"ops-{st.st_ino}-{st.st_mtime_ns}-{st.st_size}.json").is_file()
    monkeypatch.setattr(ops, "_MEMO", {})
    assert ops.find_op_symbols(libs[0]) == found  # read back from the file


def test_without_cache_directory_the_users_cache(monkeypatch):
    monkeypatch.delenv("CACHE_DIRECTORY", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", "/x/cache")
    assert str(ops._cache_dir()) == "/x/cache/stacklens"
