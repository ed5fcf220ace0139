"""Fixtures of the bpf tier: capability probe, fake GPU libraries built from C, target processes.

Root-only tests probe the capability (load a trivial BPF program) and skip with the reason.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.lines import read_line

ROOT = Path(__file__).resolve().parents[2]
FAKES = ROOT / "tests" / "fakes"
TARGETS = ROOT / "tests" / "targets"


@pytest.fixture(scope="session")
def bpf_ok(bpf_available):
    """The tier's capability probe (tests/conftest.py: skips where it cannot run, fails where it should)."""
    return True


def _cc(out: Path, *args: str) -> None:
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler to build the fake GPU libraries")
    subprocess.run([cc, "-O1", "-g", "-fno-omit-frame-pointer", "-mno-omit-leaf-frame-pointer", "-fPIC", "-o", str(out), *args], check=True)


@pytest.fixture(scope="session")
def fake_libs(tmp_path_factory) -> dict[str, Path]:
    """Builds fake libcuda.so.1, libamdhip64.so, libfakeapp.so and a symbol-less libcuda.so.1."""
    d = tmp_path_factory.mktemp("fakelibs")
    _cc(d / "libcuda.so.1", "-shared", str(FAKES / "fake_cuda.c"))
    _cc(d / "libamdhip64.so", "-shared", str(FAKES / "fake_hip.c"))
    _cc(d / "libfakeapp.so", "-shared", str(FAKES / "fake_app.c"), f"-L{d}", "-l:libcuda.so.1",
        f"-Wl,-rpath,{d}")
    (d / "nosyms").mkdir()
    _cc(d / "nosyms" / "libcuda.so.1", "-shared", str(FAKES / "fake_nosyms.c"))
    return {"dir": d, "cuda": d / "libcuda.so.1", "hip": d / "libamdhip64.so", "app": d / "libfakeapp.so",
            "nosyms": d / "nosyms" / "libcuda.so.1"}


class Target:
    """A target process from tests/targets: prints `ready`, then acts on lines sent to stdin.
    One that does not get as far as `ready` is killed before the error is raised."""

    def __init__(self, script: str, *args: str, env: dict | None = None):
        self.proc = subprocess.Popen(
            [sys.executable, str(TARGETS / script), *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True, env={**os.environ, **(env or {})}, cwd=str(ROOT))
        try:
            line = self.readline(timeout=60)
            if line != "ready":
                err = self.proc.stderr.read() if self.proc.poll() is not None else ""
                raise RuntimeError(f"target {script} said {line!r} instead of 'ready': {err}")
        except BaseException:
            self.kill()
            raise

    @property
    def pid(self) -> int:
        return self.proc.pid

    def send(self, line: str = "go") -> None:
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def readline(self, timeout: float = 60) -> str:
        """The target's next line, stripped ("" at its end); TimeoutError after `timeout` s."""
        try:
            return (read_line(self.proc.stdout, timeout) or "").strip()
        except TimeoutError:
            raise TimeoutError("target did not answer in time") from None

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for f in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            try:
                f.close()
            except OSError:
                pass


@pytest.fixture
def start_target():
    started: list[Target] = []

    def start(script: str, *args: str, env: dict | None = None) -> Target:
        t = Target(script, *args, env=env)
        started.append(t)
        return t

    try:
        yield start
    finally:
        errors = []
        for t in started:          # every one, even when killing another failed
            try:
                t.kill()
            except Exception as e:  # noqa: BLE001 — reported once all are ended
                errors.append(e)
        if errors:
            raise errors[0]


def poll_until(session, predicate, timeout_s: float = 10.0) -> list:
    """Collect events until predicate(events) holds or the timeout passes."""
    import time

    events: list = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        events.extend(session.poll(timeout_ms=100))
        if predicate(events):
            break
    return events


def uprobe_links_of(pid: int) -> int:
    """Number of uprobe_multi links whose target is pid (from bpftool-free /proc fdinfo of ours)."""
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            with open(f"/proc/self/fdinfo/{fd}") as f:
                info = f.read()
        except OSError:
            continue
        if "link_type:\tuprobe_multi" in info or "link_type:\tuprobe-multi" in info:
            n += 1
    return n
