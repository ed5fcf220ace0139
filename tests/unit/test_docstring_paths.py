"""Every file or module a package file names in its text exists (issue 45).

Checked: paths under a folder of the repository (`inject/channel/server.py`, `inject/channel/gpu`,
`inject/channel/gpu.VENDORS`; also relative to the naming file's folders, `gpu/__init__.py` in
inject/agent/gpu/), dotted names `stacklens.inject.channel.messages.HLO_LIMITS`, and the same
without `stacklens.` inside backticks (`inject.channel.agentdir.clean_stale_files`). After the
deepest module found, the next name must be defined in it (a function, class, assignment, import,
string constant or submodule). Paths outside the repository (`torch/nn/modules/linear.py`) and
bare file names are not checked.
"""

from __future__ import annotations

import ast
import re
import subprocess
from functools import cache
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
GENERATED = ("daemon/stacklens_pb2.py", "daemon/stacklens_pb2_grpc.py")   # protoc's output
NOT_PACKAGE = ("tests/", "benchmarks/", "scripts/", "docs/", "deploy/")
RATES = {"s", "ms", "us", "ns", "min", "h"}   # `records/s` is a rate, not a path

_PATH = re.compile(r"(?<![\w.\-/~])((?:[A-Za-z_][\w\-]*/)+[\w\-]+(?:\.[A-Za-z_]\w*)*)(?![\w\-*])")
_DOTTED = re.compile(r"(?<![\w./])(stacklens(?:\.[A-Za-z_]\w*)+)")
_TICKED = re.compile(r"`([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+)")


def package_files(root: Path) -> list[Path]:
    out = subprocess.run(["git", "ls-files", "-z", "*.py"], cwd=root, capture_output=True, check=True).stdout
    rels = [p for p in out.decode().split("\0") if p]
    return [root / r for r in rels
            if not r.startswith(NOT_PACKAGE) and r not in GENERATED and (root / r).exists()]


@cache
def _defined(module: Path) -> frozenset[str]:
    """The names a module file defines anywhere, its string constants, and (a package) its
    submodules: lenient, so that only a name that is nowhere there counts as missing."""
    out: set[str] = set()
    for n in ast.walk(ast.parse(module.read_text())):
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(n.name)
        elif isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store):
            out.add(n.id)
        elif isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store):
            out.add(n.attr)
        elif isinstance(n, ast.alias):
            out.add((n.asname or n.name).split(".")[0])
        elif isinstance(n, ast.Constant) and isinstance(n.value, str) and n.value.isidentifier():
            out.add(n.value)
    if module.name == "__init__.py":
        out |= {p.stem for p in module.parent.iterdir()}
    return frozenset(out)


def _module(base: Path) -> Path | None:
    if base.with_suffix(".py").is_file():
        return base.with_suffix(".py")
    if (base / "__init__.py").is_file():
        return base / "__init__.py"
    return None


def _has(module: Path | None, attrs: list[str]) -> bool:
    """Whether `module` (None: a folder that is no package) defines `attrs[0]`, if there is one."""
    return not attrs or (module is not None and attrs[0] in _defined(module))


def _path_exists(base: Path, ref: str) -> bool:
    """`ref` is a file or folder under `base`, or a module path followed by `.name`s."""
    if (base / ref).exists() or (base / f"{ref}.py").is_file():
        return True
    head, _, last = ref.rpartition("/")
    pieces = last.split(".")
    for k in range(len(pieces) - 1, 0, -1):
        stem = base / head / ".".join(pieces[:k])
        if (stem.is_dir() or stem.with_suffix(".py").is_file()) and _has(_module(stem), pieces[k:]):
            return True
    return False


def _dotted_exists(root: Path, parts: list[str]) -> bool:
    """parts (without `stacklens`) name a module of the package, then at most names defined in it."""
    for k in range(len(parts), 0, -1):
        module = _module(root.joinpath(*parts[:k]))
        if module is not None:
            return _has(module, parts[k:])
    return False


def _top_modules(root: Path) -> set[str]:
    return {p.parent.name for p in root.glob("*/__init__.py")} | ({p.stem for p in root.glob("*.py")} - {"__init__"})


def stale_references(root: Path, files: list[Path]) -> list[str]:
    """`file:line: ref` for each path or module named in `files` that is not in the repository."""
    top = _top_modules(root)
    out = []
    for path in files:
        rel = path.relative_to(root)
        bases = [root / p for p in [rel.parent, *rel.parent.parents]]
        for i, line in enumerate(path.read_text().splitlines(), 1):
            for m in _PATH.finditer(line):
                ref = m.group(1).rstrip(".")
                first = ref.split("/")[0]
                if ref.rpartition("/")[2] in RATES or not any((b / first).is_dir() for b in bases):
                    continue   # outside the repository: torch/..., Python/...
                if not any(_path_exists(b, ref) for b in bases):
                    out.append(f"{rel}:{i}: {ref}")
            dotted = [m.group(1).split(".")[1:] for m in _DOTTED.finditer(line)]
            dotted += [m.group(1).split(".") for m in _TICKED.finditer(line)]
            for parts in dotted:
                if parts[-1] == "py":   # `textsafe.py`: a module's file
                    parts = parts[:-1]
                if parts[0] in top and not _dotted_exists(root, parts):
                    out.append(f"{rel}:{i}: {'.'.join(parts)}")
    return out


def test_the_scan_sees_missing_paths_and_modules(tmp_path):
    (tmp_path / "pkg" / "sub").mkdir(parents=True)
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "sub" / "__init__.py").write_text("TABLE = {}\n")
    (tmp_path / "pkg" / "mod.py").write_text("def f():\n    pass\n")
    text = ('"""pkg/mod.py, pkg/sub, pkg/sub.TABLE, stacklens.pkg.mod.f, `pkg.sub.TABLE`, sub/__init__.py,\n'
            'torch/nn/modules/linear.py, stacklens.rules\n'
            'pkg/gone.py, pkg/old, pkg/sub.NOPE, stacklens.pkg.gone, stacklens.pkg.mod.g, `pkg.old.f`."""\n')
    (tmp_path / "pkg" / "doc.py").write_text(text)
    assert stale_references(tmp_path, [tmp_path / "pkg" / "doc.py"]) == [
        "pkg/doc.py:3: pkg/gone.py", "pkg/doc.py:3: pkg/old", "pkg/doc.py:3: pkg/sub.NOPE",
        "pkg/doc.py:3: pkg.gone", "pkg/doc.py:3: pkg.mod.g", "pkg/doc.py:3: pkg.old.f"]


def test_package_files_name_only_what_exists():
    stale = stale_references(REPO, package_files(REPO))
    assert not stale, "names of files or modules that do not exist (say where the thing is now):\n" + "\n".join(stale)
