"""No tracked file names a path of one machine (issue 34): a checkout (/work/…, /check/…), a home
(/root/…, /home/USER/…), pytest's or a fresh clone's temporary directory, pyenv's builds, or, in
benchmarks, an interpreter at a fixed place. Recorded profiles go through
tests/data/relativize.py; gzip'd files are read decompressed, other binaries skipped.

The product's own system paths (/run/stacklens, /proc, /sys, /lib/modules, /usr/share, /etc,
Debian's /usr/lib/python3/dist-packages for BCC) match no pattern here, so they need no entry.
Reads files only; no privilege."""

from __future__ import annotations

import gzip
import importlib.util
import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

# Not preceded by a path or name character: `/proc/PID/root/` and `{proc}/{pid}/root/` are a
# process's root, not root's home.
_START = r"(?<![\w.~}\])-])"
MACHINE = re.compile(_START + r"/(?:work|check|root)/"
                     r"|" + _START + r"/home/[\w.-]+/"
                     r"|/tmp/pytest-of-|/tmp/fresh"
                     r"|\.pyenv/versions")
# An interpreter named by its place instead of sys.executable or an argument (benchmarks only:
# tests and docs name /usr/bin/python3.11 as data, a mapping's path or Debian's interpreter).
INTERPRETER = re.compile(_START + r"/usr(?:/local)?/bin/python[\d.]*\b")
INTERPRETER_DIRS = ("benchmarks/",)

# Files that name machine paths on purpose, each with its reason. Keep it short.
ALLOWED = {
    "tests/unit/test_no_machine_paths.py": "this test's own examples",
    "tests/unit/test_docs.py": "test cases of the README's machine-path check",
    "tests/unit/test_export_stacks.py": "test cases: machine paths that exports must not show",
}


def _tracked() -> list[str]:
    out = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True).stdout
    return [p for p in out.decode().split("\0") if p]


def _text(path: Path) -> str | None:
    """The file's text (a .gz file's decompressed); None for a binary or a file not there."""
    try:
        raw = path.read_bytes()
    except OSError:   # listed by git, deleted in the working tree
        return None
    if raw[:2] == b"\x1f\x8b":
        raw = gzip.decompress(raw)
    if b"\0" in raw[:8192]:
        return None
    return raw.decode("utf-8", "replace")


def machine_paths(rel: str, text: str) -> list[str]:
    """`line N: match` for each machine path in `text`, the text of the tracked file `rel`."""
    pats = [MACHINE] + ([INTERPRETER] if rel.startswith(INTERPRETER_DIRS) else [])
    hits = []
    for n, line in enumerate(text.splitlines(), 1):
        for pat in pats:
            hits += [f"line {n}: {m.group(0)}" for m in pat.finditer(line)]
    return hits


def test_the_patterns_see_machine_paths_and_leave_system_paths():
    for bad in ("/work/main/tests/x.py", "py:/work/main/x.py:f:1", '"/root/out/run"', "/home/ci/src",
                "/tmp/pytest-of-root/pytest-3/x", "/tmp/fresh-clone/README.md", "~/.pyenv/versions/3.11.7"):
        assert machine_paths("docs/x.md", bad), bad
    assert machine_paths("benchmarks/b.py", 'default="/usr/bin/python3.11"')
    for good in ("/proc/123/root/usr/lib/libcuda.so", 'f"{proc}/{pid}/root/tmp"', "/run/stacklens/agents",
                 "/lib/modules/6.1/build", "/usr/lib/python3/dist-packages/bcc", "/sys/kernel/tracing",
                 "/etc/stacklens.toml", "/usr/share/doc", "tests/targets/x.py", "site-packages/torch/x.py",
                 "/usr/lib/python3.11/typing.py", "$HOME/work/x", "/homework/x"):
        assert not machine_paths("benchmarks/b.py", good), good
    assert not machine_paths("tests/unit/test_join.py", '"/usr/bin/python3.11 (deleted)"')


def test_no_tracked_file_names_a_machine_path():
    found = {}
    for rel in _tracked():
        if rel in ALLOWED:
            continue
        text = _text(REPO / rel)
        if text is not None and (hits := machine_paths(rel, text)):
            found[rel] = hits[:3] + ([f"... {len(hits) - 3} more"] if len(hits) > 3 else [])
    assert not found, ("paths of one machine (recorded profiles: tests/data/relativize.py; interpreters: "
                       f"sys.executable or an argument; docs: relative to the repository root): {found}")


@pytest.mark.parametrize("rel", sorted(ALLOWED))
def test_every_allowed_file_is_tracked(rel):
    assert (REPO / rel).is_file(), f"{rel} is in ALLOWED but gone: drop it from the list"


def test_the_relativizer_leaves_no_machine_path():
    spec = importlib.util.spec_from_file_location("relativize", REPO / "tests" / "data" / "relativize.py")
    rel = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(rel)
    top = {"tests", "cct"}
    text = ('["python","f","/work/main/tests/targets/scenario_layout.py",28]'
            '["python","g","/work/main/.venv/lib/python3.11/site-packages/torch/nn/modules/linear.py",125]'
            '["python","h","/root/.pyenv/versions/3.11.7/lib/python3.11/typing.py",359]'
            '"py:/work/main/tests/targets/gpu_copies.py:main:120;op:aten::mm" "/root/out/run" "/run/stacklens/a.py"')
    assert rel.relativize_text(text, top) == (
        '["python","f","tests/targets/scenario_layout.py",28]'
        '["python","g","site-packages/torch/nn/modules/linear.py",125]'
        '["python","h","/usr/lib/python3.11/typing.py",359]'
        '"py:tests/targets/gpu_copies.py:main:120;op:aten::mm" "~/out/run" "/run/stacklens/a.py"')
