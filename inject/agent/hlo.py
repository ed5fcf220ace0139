"""HLO text → the instructions of a compiled XLA module that can launch a kernel, with the JAX
operators each was made from (the agent's ``hlo`` records; jaxmeta.py sends them).

Stdlib only, pure: one pass over the text ``as_text()`` gives, on the agent thread. Reads both
forms of HLO metadata: ``source_file=/source_line=`` and ``stack_frame_id=`` with the module's
StackFrames table.
"""

import re

NO_KERNEL_OPCODES = frozenset(("parameter", "constant", "tuple", "get-tuple-element", "bitcast",
                               "after-all", "partition-id", "replica-id", "iota-placeholder"))
MAX_OPS = 64

_COMP_RE = re.compile(r"^(ENTRY\s+)?%?([^\s(]+)\s*\(.*\{\s*$")
_INSTR_RE = re.compile(r"^\s+(?:ROOT\s+)?%?([^\s=]+)\s*=\s*(.*)$")
_TABLE_ROW = re.compile(r"^\s*(\d+)\s+(.*)$")
_KV = re.compile(r'(\w+)=("(?:[^"\\]|\\.)*"|[^\s}]+)')


def _unquote(s):
    if len(s) >= 2 and s[0] == '"' and s[-1] == '"':
        s = s[1:-1]
        if "\\" in s:
            s = re.sub(r"\\(.)", r"\1", s)
    return s


def _braced(text, start):
    """Index just past the '}' matching the '{' at text[start] (quotes respected)."""
    depth, i, n, q = 0, start, len(text), False
    while i < n:
        c = text[i]
        if q:
            if c == "\\":
                i += 1
            elif c == '"':
                q = False
        elif c == '"':
            q = True
        elif c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    return n


def _split_type(rest):
    """'f32[2]{0} add(%a, %b), ...' -> ('add', '(%a, %b), ...'). Tuple types are skipped too."""
    i = 0
    if rest.startswith("("):
        depth = 0
        for i, c in enumerate(rest):
            if c == "(":
                depth += 1
            elif c == ")":
                depth -= 1
                if depth == 0:
                    i += 1
                    break
    else:
        i = rest.find(" ")
        if i < 0:
            return "", ""
    rest = rest[i:].lstrip()
    j = rest.find("(")
    if j < 0:
        return rest.split(",")[0].strip(), ""
    return rest[:j].strip(), rest[j:]


def _attr_refs(body, key):
    """Computation names referenced by `key=%c` or `key={%a, %b}` in an instruction's text."""
    out = []
    for m in re.finditer(r"[\s,]" + key + r"=(\{[^}]*\}|%?[^\s,}]+)", body):
        v = m.group(1)
        if v.startswith("{"):
            out.extend(x.strip().lstrip("%") for x in v[1:-1].split(",") if x.strip())
        else:
            out.append(v.lstrip("%"))
    return out


def _metadata(body):
    i = body.find("metadata={")
    if i < 0:
        return None
    j = i + len("metadata=")
    inner = body[j + 1:_braced(body, j) - 1]
    return {k: _unquote(v) for k, v in _KV.findall(inner)}


def parse_hlo_text(text):  # long: agent code, one pass over HLO text; split with the GPU matrix run
    """HLO module text -> (module name, kernel entries).

    Entries, in schedule order of the computations that run kernels (ENTRY with the computations
    of its ``call`` instructions inlined — XLA:GPU command buffers —, then while bodies, conditions
    and conditional branches reachable from it): ``[name, opcode, ops]`` where ops
    are the distinct ``(op_name, file, line, function)`` of the original operators: those of the
    instructions inside a fusion's called computations (nested fusions included), else the
    instruction's own metadata.
    """
    lines = text.splitlines()
    module = ""
    tables = {"FileNames": {}, "FunctionNames": {}, "FileLocations": {}, "StackFrames": {}}
    comps = {}
    entry = None
    cur = None
    table = None
    for line in lines:
        if cur is not None:
            if line.startswith("}"):
                cur = None
                continue
            m = _INSTR_RE.match(line)
            if m:
                name, rest = m.group(1), m.group(2)
                opcode, body = _split_type(rest)
                cur.append((name, opcode, body))
            continue
        if line.startswith("HloModule "):
            module = line[10:].split(",")[0].strip()
            continue
        s = line.strip()
        if s in tables:
            table = tables[s]
            continue
        if not s:
            table = None
            continue
        if table is not None:
            m = _TABLE_ROW.match(line)
            if m:
                table[int(m.group(1))] = m.group(2)
                continue
            table = None
        m = _COMP_RE.match(line)
        if m:
            cur = comps.setdefault(m.group(2), [])
            if m.group(1):
                entry = m.group(2)
    files = {k: _unquote(v) for k, v in tables["FileNames"].items()}
    funcs = {k: _unquote(v) for k, v in tables["FunctionNames"].items()}
    locs = {}
    for k, v in tables["FileLocations"].items():
        d = dict(_KV.findall(v))
        try:
            locs[k] = (files.get(int(d.get("file_name_id", 0)), ""),
                       int(d.get("line", 0)), funcs.get(int(d.get("function_name_id", 0)), ""))
        except ValueError:
            pass
    frames = {}
    for k, v in tables["StackFrames"].items():
        d = dict(_KV.findall(v))
        try:
            frames[k] = locs.get(int(d.get("file_location_id", 0)))
        except ValueError:
            pass

    def op_of(body):
        md = _metadata(body)
        if not md or not md.get("op_name"):
            return None
        f, line, fn = "", 0, ""
        if md.get("source_file"):
            f = md["source_file"]
            try:
                line = int(md.get("source_line", 0))
            except ValueError:
                line = 0
        elif md.get("stack_frame_id"):
            try:
                loc = frames.get(int(md["stack_frame_id"]))
            except ValueError:
                loc = None
            if loc:
                f, line, fn = loc
        return (md["op_name"], f, max(0, line), fn)

    def fused_ops(comp, seen, out):
        if comp in seen or comp not in comps:
            return
        seen.add(comp)
        for name, opcode, body in comps[comp]:
            if opcode == "parameter":
                continue
            for c in _attr_refs(body, "calls"):
                fused_ops(c, seen, out)
            op = op_of(body)
            if op is not None and op not in out:
                out[op] = None

    if entry is None:
        return module, []
    entries = []
    queue, seen_c = [entry], set()

    def walk(c, depth):
        # a computation's kernels in schedule order; a `call` (e.g. an XLA:GPU command buffer,
        # `call(...), to_apply=%command_buffer`) is inlined where it runs; while bodies and
        # conditional branches are queued and listed after
        if c in seen_c or c not in comps or depth > 64:
            return
        seen_c.add(c)
        for name, opcode, body in comps[c]:
            if opcode == "call":
                for callee in _attr_refs(body, "to_apply"):
                    walk(callee, depth + 1)
                continue
            for key in ("body", "condition", "branch_computations", "true_computation",
                        "false_computation"):
                queue.extend(_attr_refs(body, key))
            if opcode in NO_KERNEL_OPCODES or opcode in ("while", "conditional"):
                continue
            ops = {}
            for callee in _attr_refs(body, "calls"):
                fused_ops(callee, set(), ops)
            if not ops:
                op = op_of(body)
                if op is not None:
                    ops[op] = None
            entries.append([name, opcode, [list(o) for o in list(ops)[:MAX_OPS]]])

    while queue:
        walk(queue.pop(0), 0)
    return module, entries


# ---- call sites ---------------------------------------------------------------------------------
