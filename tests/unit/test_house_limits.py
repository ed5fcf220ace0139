"""No package file over 600 lines, no class over 350 and no function over 80 (issues 34 and 45),
generated code aside.

A file, class or function that must stay longer says why in the code: a comment `# long: REASON`
on the line of its `def` or `class` (a function, a class) or within its first 30 lines (a module).
The reasons are listed when the test runs, so that they stay few and stay read.
"""

from __future__ import annotations

import ast
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
MAX_FILE_LINES = 600
MAX_CLASS_LINES = 350
MAX_FUNCTION_LINES = 80
GENERATED = ("daemon/stacklens_pb2.py", "daemon/stacklens_pb2_grpc.py")   # protoc's output
NOT_PACKAGE = ("tests/", "benchmarks/", "scripts/", "docs/", "deploy/")
REASON = "# long:"


def package_files() -> list[Path]:
    out = subprocess.run(["git", "ls-files", "-z", "*.py"], cwd=REPO, capture_output=True, check=True).stdout
    rels = [p for p in out.decode().split("\0") if p]
    return [REPO / r for r in rels
            if not r.startswith(NOT_PACKAGE) and r not in GENERATED and (REPO / r).exists()]


def over_limits(path: Path, root: Path = REPO) -> tuple[list[str], list[str]]:
    """(what is over a limit without a reason, the reasons given) of one file below `root`."""
    text = path.read_text()
    lines = text.splitlines()
    rel = path.relative_to(root)
    over, reasons = [], []
    if len(lines) > MAX_FILE_LINES:
        why = next((ln for ln in lines[:30] if REASON in ln), None)
        (reasons if why else over).append(f"{rel}: {len(lines)} lines" + (f" ({why.strip()})" if why else ""))
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            n = node.end_lineno - node.lineno + 1
            if n > (MAX_CLASS_LINES if isinstance(node, ast.ClassDef) else MAX_FUNCTION_LINES):
                why = REASON in lines[node.lineno - 1]
                entry = f"{rel}:{node.lineno} {node.name}: {n} lines"
                (reasons if why else over).append(entry + (f" ({lines[node.lineno - 1].split(REASON)[1].strip()})"
                                                           if why else ""))
    return over, reasons


def test_the_limits_see_a_long_function_and_its_reason(tmp_path):
    body = "\n".join(f"    x{i} = {i}" for i in range(90))
    (tmp_path / "m.py").write_text(f"def f():\n{body}\n\n\ndef g():  {REASON} a table\n{body}\n")
    over, reasons = over_limits(tmp_path / "m.py", tmp_path)
    assert over == ["m.py:1 f: 91 lines"] and reasons == ["m.py:94 g: 91 lines (a table)"]


def test_the_limits_see_a_long_class(tmp_path):
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_CLASS_LINES))
    (tmp_path / "m.py").write_text(f"class C:\n{body}\n")
    over, _ = over_limits(tmp_path / "m.py", tmp_path)
    assert over == [f"m.py:1 C: {MAX_CLASS_LINES + 1} lines"]


def test_no_package_file_or_function_over_the_limits():
    files = package_files()
    assert len(files) > 100, "the package's files were not found"
    over, reasons = [], []
    for path in files:
        o, r = over_limits(path)
        over += o
        reasons += r
    print("kept long, with a reason:", *reasons, sep="\n  ")
    assert not over, (f"over {MAX_FILE_LINES} lines a file, {MAX_CLASS_LINES} a class or {MAX_FUNCTION_LINES} "
                      f"a function: {over}")
    assert len(reasons) <= 5, reasons   # exceptions stay exceptions
