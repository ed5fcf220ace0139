"""One target-introspection layer (stacklens.introspect, issue 19): /proc is read only there, and
there is one CPython locator, one `_Py_DebugOffsets` reader, one remote-memory Protocol and one
Frame. The import direction is an import-linter contract (pyproject.toml); this checks the source.

Scope: the package's source outside tests/ and benchmarks/ (measurement scripts that read their
own /proc/self, not shipped), and outside inject/agent/ (it runs inside the target, imports
nothing of the daemon and may read its own /proc/self)."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).parents[2]
LAYER = REPO / "introspect"


def _sources() -> list[Path]:
    out = []
    for p in sorted(REPO.rglob("*.py")):
        rel = p.relative_to(REPO)
        if rel.parts[0].startswith(".") or rel.parts[0] in ("tests", "benchmarks", "build"):
            continue
        if rel.parts[:2] == ("inject", "agent") or rel.parts[0].endswith(".egg-info"):
            continue
        out.append(p)
    return out


def _strings(tree: ast.AST):
    """String constants and the literal start of f-strings, with their line."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, (str, bytes)):
            yield node.lineno, node.value
        elif isinstance(node, ast.JoinedStr) and node.values and isinstance(node.values[0], ast.Constant):
            yield node.lineno, node.values[0].value


def _where(pred) -> list[str]:
    hits = []
    for p in _sources():
        tree = ast.parse(p.read_text(), str(p))
        hits += [f"{p.relative_to(REPO)}:{line}" for line, s in _strings(tree) if pred(p, s)]
    return hits


def _defs(kind: type, name: str) -> list[str]:
    hits = []
    for p in _sources():
        tree = ast.parse(p.read_text(), str(p))
        hits += [f"{p.relative_to(REPO)}:{n.lineno}" for n in ast.walk(tree)
                 if isinstance(n, kind) and n.name == name]
    return hits


def test_sources_are_found():
    names = {p.relative_to(REPO).as_posix() for p in _sources()}
    assert {"introspect/procfs.py", "bpf/session.py", "daemon/core.py", "inject/channel/server.py"} <= names
    assert not any(n.startswith(("tests/", "inject/agent/")) for n in names)


def test_no_proc_path_outside_the_introspection_layer():
    # a path literal, not prose: error messages name /proc files mid-sentence, never at the start
    hits = _where(lambda p, s: isinstance(s, str) and s.startswith("/proc") and LAYER not in p.parents)
    assert hits == [], f"/proc read outside stacklens.introspect (use ProcFS): {hits}"


def test_no_path_built_from_the_procfs_root_outside_the_layer():
    hits = []
    for p in _sources():
        if LAYER in p.parents:
            continue
        tree = ast.parse(p.read_text(), str(p))
        hits += [f"{p.relative_to(REPO)}:{n.lineno}" for n in ast.walk(tree)
                 if isinstance(n, ast.Attribute) and n.attr == "root" and isinstance(n.value, (ast.Name, ast.Attribute))
                 and (getattr(n.value, "id", "") or getattr(n.value, "attr", "")).lstrip("_") == "procfs"]
    assert hits == [], f"a /proc path built outside ProcFS: {hits}"


def test_one_cpython_locator_and_one_debug_offsets_reader():
    assert _defs(ast.FunctionDef, "find_python") == ["introspect/cpython.py:" + _line("cpython.py", "def find_python(")]
    cookies = _where(lambda p, s: s == b"xdebugpy")
    assert cookies == ["introspect/debug_offsets.py:" + _line("debug_offsets.py", 'DEBUG_COOKIE = b"xdebugpy"')]


def _version_keyed_dicts() -> list[str]:
    """Dict literals keyed by CPython version tuples, `{(3, 12): ...}`: a version table."""
    hits = []
    for p in _sources():
        tree = ast.parse(p.read_text(), str(p))
        for n in ast.walk(tree):
            if isinstance(n, ast.Dict) and any(
                    isinstance(k, ast.Tuple) and len(k.elts) == 2 and isinstance(k.elts[0], ast.Constant)
                    and k.elts[0].value == 3 for k in n.keys):
                hits.append(f"{p.relative_to(REPO)}:{n.lineno}")
    return hits


def test_one_cpython_version_table():
    """Frame layouts and PEP 768's fields are one table (issue 34); a second one would drift."""
    table = "introspect/python_layouts.py:" + _line("python_layouts.py", "LAYOUTS: dict[")
    assert _version_keyed_dicts() == [table]
    assert [h.split(":")[0] for h in _defs(ast.ClassDef, "RemoteDebugLayout")] == ["introspect/python_layouts.py"]


def test_one_ptrace_binding_one_iovec():
    """The injector and `stacklens record` share one ptrace binding (issue 34): libc's ptrace is
    bound, and PTRACE_* requests named, in introspect/ptrace.py only; struct iovec once."""
    bound, named = [], []
    for p in _sources():
        tree = ast.parse(p.read_text(), str(p))
        rel = p.relative_to(REPO).as_posix()
        bound += [rel for n in ast.walk(tree) if isinstance(n, ast.Attribute) and n.attr == "ptrace"]
        named += [rel for n in ast.walk(tree) if isinstance(n, ast.Assign) for t in n.targets
                  if isinstance(t, ast.Name) and t.id.startswith("PTRACE_")]
    assert set(bound) == {"introspect/ptrace.py"}, bound
    assert set(named) == {"introspect/ptrace.py"}, named
    iovecs = _defs(ast.ClassDef, "IOVec") + _defs(ast.ClassDef, "_IOVec")
    assert [h.split(":")[0] for h in iovecs] == ["introspect/memory.py"]


def test_one_pid_check():
    """bpf/ and daemon/ ask one function whether a PID is there (issue 34)."""
    for name in ("check_pid", "pid_alive"):
        assert [h.split(":")[0] for h in _defs(ast.FunctionDef, name)] == ["introspect/procfs.py"], name


def test_one_memory_protocol_one_proc_mem_reader_one_frame():
    assert [h.split(":")[0] for h in _defs(ast.ClassDef, "ProcessMemory")] == ["introspect/memory.py"]
    assert [h.split(":")[0] for h in _defs(ast.ClassDef, "MemoryReadError")] == ["errors.py"]
    assert [h.split(":")[0] for h in _defs(ast.ClassDef, "Frame")] == ["cct/frames.py"]
    preads = []
    for p in _sources():
        tree = ast.parse(p.read_text(), str(p))
        preads += [p.relative_to(REPO).as_posix() for n in ast.walk(tree)
                   if isinstance(n, ast.Attribute) and n.attr == "pread"]
    assert preads == ["introspect/memory.py"], preads


def _line(name: str, text: str) -> str:
    for i, line in enumerate((LAYER / name).read_text().splitlines(), 1):
        if line.startswith(text):
            return str(i)
    raise AssertionError(f"{text!r} not in introspect/{name}")
