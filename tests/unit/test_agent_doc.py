"""docs/agent-in-target.md lists what the agent's code does in a target, and nothing it does not.

The code that runs in a target is read with ``ast``: every file under ``inject/agent/`` and the
text ``inject/bootstrap.py`` formats for the target (``_BODY``, its placeholders filled from the
module's constants, so the thread gets its real name). Five things are collected, each against one
``### `` section of the doc's inventory (a bullet's backticked names before its " — "):

1. Imports: the top-level name of every ``import`` / ``from … import`` (absolute) and of
   ``importlib.import_module`` / ``__import__`` with a constant argument. The agent's own modules
   are loaded from its files by ``_sub``, not imported by name.
2. Threads: ``threading.Thread`` / ``Timer`` / ``_thread.start_new_thread`` calls (the ``name=``
   constant, else the target) and classes derived from ``threading.Thread``.
3. Hooks and process-wide settings: calls of the stdlib's hook and setting functions (``HOOKS``,
   ``HOOK_PREFIXES``), a library's ``register_…_listener`` / ``add_…_hook``-style call (its module
   followed through ``x = sys.modules.get("…")``), assignments to a module's attribute
   (``sys.excepthook = …``), ``setattr(module, …)`` and ``sys.modules[…] = …``.
4. GPU vendor calls, by C name: attributes of a ``ctypes.CDLL`` and string constants passed with
   one (``getattr(dll, "cuptiX")``, a helper's ``fn(dll, "cuptiX")``); attributes of the
   cupti-python module (``from cupti import cupti``, followed through the functions that return
   it and the names and attributes assigned from them), ``activity_enable`` read as
   ``cuptiActivityEnable``; and, as a net, any name or whole string constant shaped like a CUDA,
   CUPTI, ROCm or NVML function (``VENDOR_NAME``).
5. Heap and frame reads: every ``gc.*`` and ``sys._current_frames`` / ``sys._getframe`` reference
   and every ``.f_locals`` read.

Aliases are followed within one file: a local name within its function, anything else
(``self._lib``) by its source text; good enough for the agent's code, and the self-tests below pin
what the collector must find. The doc's in-page links are checked too. Reads files only; no
privilege.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOC_PATH = ROOT / "docs" / "agent-in-target.md"
AGENT_DIR = ROOT / "inject" / "agent"
BOOTSTRAP = ROOT / "inject" / "bootstrap.py"

WHAT = {"imports": "import", "threads": "thread", "hooks": "hook or setting", "vendor": "GPU vendor call",
        "reads": "heap or frame read"}
SECTIONS = {                       # category -> the doc's "### " heading that lists it
    "imports": "Modules imported",
    "threads": "Threads started",
    "hooks": "Hooks and process-wide settings",
    "vendor": "CUDA, CUPTI and ROCm calls",
    "reads": "Heap and frame reads",
}

THREAD_CALLS = {"threading.Thread", "threading.Timer", "_thread.start_new_thread", "_thread.start_new"}
HOOKS = {
    "os.register_at_fork", "atexit.register", "sys.settrace", "sys.setprofile", "threading.settrace",
    "threading.setprofile", "threading.settrace_all_threads", "threading.setprofile_all_threads",
    "sys.addaudithook", "sys.setswitchinterval", "sys.setrecursionlimit", "sys.set_asyncgen_hooks",
    "sys.set_coroutine_origin_tracking_depth", "sys.setdlopenflags", "sys.set_int_max_str_digits",
    "sys.activate_stack_trampoline", "gc.disable", "gc.enable", "gc.set_threshold", "gc.set_debug",
    "gc.freeze", "gc.unfreeze", "gc.callbacks.append", "gc.callbacks.insert", "gc.callbacks.extend",
    "sys.meta_path.append", "sys.meta_path.insert", "sys.path_hooks.append", "sys.path_hooks.insert",
    "sys.path.append", "sys.path.insert", "os.putenv", "os.unsetenv", "os.environ.update",
    "os.environ.setdefault", "threading.stack_size", "weakref.finalize", "tracemalloc.start",
    "warnings.filterwarnings", "warnings.simplefilter", "logging.basicConfig", "os.nice",
    "os.sched_setaffinity", "os.setpriority", "os.chdir", "os.umask",
}
HOOK_PREFIXES = ("sys.monitoring.", "signal.", "faulthandler.", "ctypes.pythonapi.")
LISTENER = re.compile(r"^(register|add|install|set)_\w*(listener|hook|callback|handler)s?$|"
                      r"^register_\w+$|^add_\w+_listener$")
CDLL_CALLS = {"ctypes.CDLL", "ctypes.PyDLL", "ctypes.cdll.LoadLibrary", "ctypes.CDLL.LoadLibrary"}
CUPTI_PYTHON = "cupti.cupti"
VENDOR_NAME = re.compile(r"^(cupti[A-Z]\w*|cuda[A-Z]\w*|cu[A-Z][a-z]\w*|nvml[A-Z]\w*|hip[A-Z]\w*|"
                         r"roctracer_\w+|rocprofiler_\w+|hsa_\w+)$")
READS = ("gc.", "sys._current_frames", "sys._getframe")


# ---- reading the code ---------------------------------------------------------------------------

def bootstrap_target_texts(source: str) -> list[str]:
    """What the bootstrap module runs in a target: each module-level string it ``.format``s, filled
    from the module's constants (a parameter becomes ``'<name>'``), with blank lines before it so
    that its line numbers are the module's."""
    tree = ast.parse(source)
    consts, starts = {}, {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            try:
                consts[node.targets[0].id] = ast.literal_eval(node.value)
                starts[node.targets[0].id] = node.value.lineno
            except ValueError:
                pass
    texts = []
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "format"
                and isinstance(node.func.value, ast.Name) and isinstance(consts.get(node.func.value.id), str)):
            values = {kw.arg: consts.get(kw.value.id, f"<{kw.arg}>") if isinstance(kw.value, ast.Name)
                      else f"<{kw.arg}>" for kw in node.keywords}
            name = node.func.value.id
            texts.append("\n" * (starts[name] - 1) + consts[name].format(**values))
    return texts


def agent_sources() -> dict[str, str]:
    """{path relative to the repository: the source that runs in a target}."""
    out = {str(p.relative_to(ROOT)): p.read_text() for p in sorted(AGENT_DIR.rglob("*.py"))}
    for i, text in enumerate(bootstrap_target_texts(BOOTSTRAP.read_text())):
        out[str(BOOTSTRAP.relative_to(ROOT)) + (f" (text {i + 1})" if i else "")] = text
    return out


def _dotted(node, names: dict[str, str]) -> str | None:
    """``a.b.c`` with its head resolved through the file's imports and module lookups, or None."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    parts.append(names.get(node.id, node.id))
    return ".".join(reversed(parts))


def _module_lookup(value) -> str | None:
    """The module name of ``sys.modules.get("m")`` / ``sys.modules["m"]``."""
    if isinstance(value, ast.Call) and isinstance(value.func, ast.Attribute) and value.func.attr == "get":
        holder, args = value.func.value, value.args
    elif isinstance(value, ast.Subscript):
        holder, args = value.value, [value.slice]
    else:
        return None
    if ast.unparse(holder) == "sys.modules" and args and isinstance(args[0], ast.Constant) \
            and isinstance(args[0].value, str):
        return args[0].value
    return None


def _scopes(tree) -> dict[int, int]:
    """id(node) -> id of the innermost function around it (0: the module)."""
    out = {}

    def visit(node, scope):
        out[id(node)] = scope
        inner = id(node) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)) else scope
        for child in ast.iter_child_nodes(node):
            visit(child, inner)
    visit(tree, 0)
    return out


def _key(expr, scope):
    """A local name is itself in its function; anything else (``self._lib``) is its text."""
    return (scope, expr.id) if isinstance(expr, ast.Name) else (-1, ast.unparse(expr))


def _pairs(tree, scope_of):
    """(target, value, scope) of every assignment, tuples unpacked pairwise."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            for t in node.targets:
                if isinstance(t, ast.Tuple) and isinstance(node.value, ast.Tuple) \
                        and len(t.elts) == len(node.value.elts):
                    for a, b in zip(t.elts, node.value.elts):
                        yield a, b, scope_of[id(node)]
                else:
                    yield t, node.value, scope_of[id(node)]


class _Aliases:
    """What holds an object that ``seed(value)`` makes (or that the names in ``keys`` are bound
    to): followed through assignments and through functions that return it, to a fixed point."""

    def __init__(self, tree, scope_of, seed=lambda v: False, keys=()):
        self.held = set(keys)
        makers: set[str] = set()
        funcs = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
        while True:
            before = (len(self.held), len(makers))
            for t, v, scope in _pairs(tree, scope_of):
                if seed(v) or self.holds(v, scope) or (isinstance(v, ast.Call) and ast.unparse(v.func) in makers):
                    self.held.add(_key(t, scope))
            for f in funcs:
                if any(isinstance(r, ast.Return) and r.value is not None and self.holds(r.value, scope_of[id(r)])
                       for r in ast.walk(f)):
                    makers.add(f.name)
            if (len(self.held), len(makers)) == before:
                break

    def holds(self, expr, scope) -> bool:
        return _key(expr, scope) in self.held or (isinstance(expr, ast.Name) and (0, expr.id) in self.held)


def _cupti_c_name(attr: str) -> str:
    """cupti-python's ``activity_enable`` is CUPTI's ``cuptiActivityEnable``."""
    return "cupti" + "".join(p.capitalize() for p in attr.split("_"))


Found = dict[str, dict[str, list[str]]]       # category -> item -> ["file:line", ...]


class _File:
    """One source's facts for the classifiers: what its names stand for."""

    def __init__(self, label: str, text: str):
        self.label = label
        self.tree = ast.parse(text)
        self.scope_of = _scopes(self.tree)
        self.names: dict[str, str] = {}     # local name -> dotted module path
        self.consts: dict[str, str] = {}    # module-level NAME = "string"
        cupti_keys = set()                  # where an import binds cupti-python's module
        for node in ast.walk(self.tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    self.names[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                for a in node.names:
                    self.names[a.asname or a.name] = f"{node.module}.{a.name}"
                    if f"{node.module}.{a.name}" == CUPTI_PYTHON:
                        cupti_keys.add((self.scope_of[id(node)], a.asname or a.name))
        for node in self.tree.body:
            if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name) \
                    and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
                self.consts[node.targets[0].id] = node.value.value
        for t, v, _scope in _pairs(self.tree, self.scope_of):
            mod = _module_lookup(v)
            if mod is not None and isinstance(t, ast.Name):
                self.names[t.id] = mod
        self.cdlls = _Aliases(self.tree, self.scope_of, self._made_by(*CDLL_CALLS))
        self.cupti_py = _Aliases(self.tree, self.scope_of, keys=cupti_keys)
        self.own_modules = _Aliases(self.tree, self.scope_of, self._made_by("types.ModuleType"))

    def _made_by(self, *calls):
        return lambda v: isinstance(v, ast.Call) and self.dotted(v.func) in calls

    def dotted(self, node) -> str | None:
        return _dotted(node, self.names)

    def is_module(self, dotted: str | None) -> bool:
        return dotted is not None and dotted in self.names.values()


def _imports(f: _File, node, scope):
    if isinstance(node, ast.Import):
        for a in node.names:
            yield a.name.split(".")[0]
    elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module != "__future__":
        yield node.module.split(".")[0]
    elif isinstance(node, ast.Call) and f.dotted(node.func) in ("importlib.import_module", "__import__") \
            and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
        yield node.args[0].value.split(".")[0]


def _threads(f: _File, node, scope):
    if isinstance(node, ast.Call) and f.dotted(node.func) in THREAD_CALLS:
        kw = {k.arg: k.value for k in node.keywords}
        name = kw.get("name")
        if isinstance(name, ast.Constant) and isinstance(name.value, str):
            yield name.value
        else:
            what = name or kw.get("target") or kw.get("function") or (node.args[0] if node.args else None)
            yield ast.unparse(what) if what is not None else f.dotted(node.func)
    elif isinstance(node, ast.ClassDef) and any(f.dotted(b) == "threading.Thread" for b in node.bases):
        yield node.name


def _hooks(f: _File, node, scope):
    if isinstance(node, ast.Call):
        func = f.dotted(node.func)
        if func is None:
            return
        if func in HOOKS or func.startswith(HOOK_PREFIXES):
            yield func
        elif isinstance(node.func, ast.Attribute) and LISTENER.match(node.func.attr) \
                and not (f.cdlls.holds(node.func.value, scope) or f.cupti_py.holds(node.func.value, scope)):
            yield func                                   # a library's listener (JAX's monitoring)
        elif func == "setattr" and len(node.args) >= 2 and f.is_module(f.dotted(node.args[0])):
            key = node.args[1]
            key = key.value if isinstance(key, ast.Constant) else f.consts.get(getattr(key, "id", ""), "?")
            yield f"{f.dotted(node.args[0])}.{key}"
    elif isinstance(node, (ast.Assign, ast.AugAssign)):
        for t in node.targets if isinstance(node, ast.Assign) else [node.target]:
            for sub in t.elts if isinstance(t, ast.Tuple) else [t]:
                if isinstance(sub, ast.Subscript) and f.dotted(sub.value) in ("sys.modules", "os.environ"):
                    yield f.dotted(sub.value)
                elif isinstance(sub, ast.Attribute) and f.is_module(f.dotted(sub.value)) \
                        and not f.own_modules.holds(sub.value, scope):
                    yield f"{f.dotted(sub.value)}.{sub.attr}"      # sys.excepthook = ...


def _vendor(f: _File, node, scope):
    if isinstance(node, ast.Call) and any(f.cdlls.holds(a, scope) for a in node.args):
        for a in node.args:                              # fn(dll, "cuptiX", ...), getattr(dll, "cuptiX")
            if isinstance(a, ast.Constant) and isinstance(a.value, str) and a.value.isidentifier():
                yield a.value
    elif isinstance(node, ast.Attribute):
        if f.cdlls.holds(node.value, scope):
            yield node.attr
        elif f.cupti_py.holds(node.value, scope) and re.fullmatch(r"[a-z][a-z0-9_]*", node.attr) \
                and not node.attr.endswith("_dtype"):     # functions; enums are CamelCase, dtypes data
            yield _cupti_c_name(node.attr)
    name = node.value if isinstance(node, ast.Constant) else getattr(node, "attr", getattr(node, "id", None))
    if isinstance(name, str) and VENDOR_NAME.match(name):
        yield name                                       # the net: anything named like one


def _reads(f: _File, node, scope):
    if isinstance(node, ast.Attribute):
        dotted = f.dotted(node)
        if dotted is not None and isinstance(node.value, ast.Name) and dotted.startswith(READS):
            yield dotted
        if node.attr == "f_locals":
            yield "f_locals"


CLASSIFIERS = {"imports": _imports, "threads": _threads, "hooks": _hooks, "vendor": _vendor, "reads": _reads}


def collect(sources: dict[str, str]) -> Found:
    """{category: {item: ["file:line", ...]}} of the given sources ({label: text})."""
    found: Found = {c: {} for c in SECTIONS}
    for label, text in sources.items():
        f = _File(label, text)
        for node in ast.walk(f.tree):
            scope = f.scope_of[id(node)]
            for category, classify in CLASSIFIERS.items():
                for item in classify(f, node, scope):
                    where = found[category].setdefault(item, [])
                    loc = f"{label}:{getattr(node, 'lineno', '?')}"
                    if loc not in where:
                        where.append(loc)
    return found


# ---- reading the doc ----------------------------------------------------------------------------

BULLET_NAMES = re.compile(r"`([^`]+)`")


def doc_inventory(text: str) -> dict[str, dict[str, int]]:
    """{category: {name: line}} from the doc's ``### <SECTIONS[category]>`` lists: each bullet
    (``- ``) names its entries in backticks before its first " — "."""
    out: dict[str, dict[str, int]] = {c: {} for c in SECTIONS}
    by_heading = {h: c for c, h in SECTIONS.items()}
    current = None
    for i, line in enumerate(text.splitlines(), 1):
        if line.startswith("#"):
            current = by_heading.get(line.lstrip("#").strip()) if line.startswith("### ") else None
        elif current is not None and line.startswith("- "):
            head = line[2:].split(" — ", 1)[0]
            for name in BULLET_NAMES.findall(head):
                out[current][name] = i
    return out


# ---- the tests ----------------------------------------------------------------------------------

def _mismatches(found: Found, doc: dict[str, dict[str, int]], rel="docs/agent-in-target.md") -> list[str]:
    msgs = []
    for c, heading in SECTIONS.items():
        for item, where in sorted(found[c].items()):
            if item not in doc[c]:
                msgs.append(f"{where[0]}: {WHAT[c]} `{item}` is not listed under '### {heading}' in {rel}")
        for item, line in sorted(doc[c].items()):
            if item not in found[c]:
                msgs.append(f"{rel}:{line}: `{item}` is listed under '### {heading}' but the agent's code "
                            f"has no such {WHAT[c]}")
    return msgs


def test_the_doc_lists_exactly_what_the_agent_imports_starts_hooks_and_calls():
    msgs = _mismatches(collect(agent_sources()), doc_inventory(DOC_PATH.read_text()))
    assert not msgs, "\n" + "\n".join(msgs)


def test_the_agent_inventory_is_not_empty():
    """The real code yields the entries issue 45 found missing: a collector that found nothing
    would pass the test above against an empty doc."""
    found = collect(agent_sources())
    assert {"socket", "sys", "threading", "ctypes", "cupti", "gc"} <= set(found["imports"])
    assert set(found["threads"]) == {"stacklens-agent"}
    assert {"os.register_at_fork", "sys.setswitchinterval", "sys.modules",
            "jax._src.monitoring.register_event_duration_secs_listener"} <= set(found["hooks"])
    assert {"cuptiFinalize", "cuptiActivityEnable", "cuptiActivityRegisterCallbacks",
            "roctracer_open_pool_expl", "cudaRuntimeGetVersion"} <= set(found["vendor"])
    assert {"gc.get_referrers", "sys._current_frames", "f_locals"} <= set(found["reads"])


def test_the_collector_finds_each_kind_in_a_small_source(tmp_path):
    src = tmp_path / "guest.py"
    src.write_text(
        "import os\n"
        "import json as j\n"
        "from threading import Thread\n"
        "from cupti import cupti\n"
        "import ctypes, gc, sys\n"
        "def work(): pass\n"
        "Thread(target=work, name='guest-worker', daemon=True).start()\n"
        "os.register_at_fork(after_in_child=work)\n"
        "mon = sys.modules.get('jax._src.monitoring')\n"
        "mon.register_event_duration_secs_listener(work)\n"
        "lib = cupti\n"
        "lib.activity_flush_all(0)\n"
        "dll = ctypes.CDLL('libcupti.so')\n"
        "dll.cuptiFinalize()\n"
        "gc.get_referrers(object)\n"
    )
    found = collect({str(src): src.read_text()})
    assert set(found["imports"]) == {"os", "json", "threading", "cupti", "ctypes", "gc", "sys"}
    assert set(found["threads"]) == {"guest-worker"}
    assert set(found["hooks"]) == {"os.register_at_fork",
                                   "jax._src.monitoring.register_event_duration_secs_listener"}
    assert set(found["vendor"]) == {"cuptiActivityFlushAll", "cuptiFinalize"}
    assert set(found["reads"]) == {"gc.get_referrers"}
    assert found["threads"]["guest-worker"] == [f"{src}:7"]


def test_the_bootstrap_text_is_read_with_its_constants_and_its_lines():
    [text] = bootstrap_target_texts(
        'NAME = "t-1"\n_BODY = """\nimport socket\nimport threading\n'
        'threading.Thread(target=f, name={name!r}).start()\nconnect({sock!r})\n"""\n'
        'def body(p):\n    return _BODY.format(name=NAME, sock=p)\n')
    assert collect({"b.py": text})["threads"] == {"t-1": ["b.py:5"]}
    assert "connect('<sock>')" in text
    assert "os.register_at_fork" in BOOTSTRAP.read_text().splitlines()[
        int(collect(agent_sources())["hooks"]["os.register_at_fork"][0].rsplit(":", 1)[1]) - 1]


def test_a_missing_and_a_stale_entry_are_both_named():
    found = {c: {} for c in SECTIONS}
    found["threads"] = {"new-thread": ["inject/agent/x.py:3"]}
    doc = doc_inventory("### Threads started\n- `old-thread` — gone\n")
    assert _mismatches(found, doc, rel="d.md") == [
        "inject/agent/x.py:3: thread `new-thread` is not listed under '### Threads started' in d.md",
        "d.md:2: `old-thread` is listed under '### Threads started' but the agent's code has no such thread"]


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_the_docs_links_within_the_page_resolve():
    text = DOC_PATH.read_text()
    anchors = {_slug(h) for h in re.findall(r"^#+ (.+)$", text, re.M)}
    assert {"what-stays-after-detach", "inventory"} <= anchors
    broken = sorted(set(re.findall(r"\]\(#([^)]+)\)", text)) - anchors)
    assert not broken, f"{DOC_PATH.relative_to(ROOT)}: in-page links to no heading: {broken}"


def test_the_doc_reader_takes_backticked_names_before_the_dash():
    doc = ("## Inventory\n### Threads started\n- `a-thread` — runs `not-this`\n"
           "### Heap and frame reads\n- `gc.get_referrers`, `f_locals` — see above\n"
           "### Other\n- `ignored` — not a section of ours\n")
    inv = doc_inventory(doc)
    assert inv["threads"] == {"a-thread": 3}
    assert set(inv["reads"]) == {"gc.get_referrers", "f_locals"}
    assert inv["imports"] == {}
