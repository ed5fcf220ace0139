"""torch.compile (Inductor): what runs on a line of a generated wrapper charged to the model's lines.

Inductor runs a compiled graph as a generated Python module (``/tmp/torchinductor_<user>/…/c….py``)
whose ``call`` function allocates buffers and calls one kernel per line (C++ ``cpp_fused_*`` on
CPU, Triton ``triton_*`` on GPU, ``extern_kernels.*`` for library calls). Every sample and kernel
of the graph lands on such a line. The agent (``inject/agent/inductor.py``) sends, per module,
Inductor's own line map (``PyCodeCache.linemaps``: for each region of the wrapper the FX
``stack_trace`` of the last FX node of the scheduler node generated there), the post-grad FX
nodes' source lines and the wrapper's comments and ``call`` body. Here that becomes, per wrapper
line, the model lines it stands for, and a path through the wrapper is rewritten:

    … → py:model.py:forward:8 (the line map's stack, outermost first) → op:[compiled] NAME → native/api/kernel …

Rules (also in the snapshot's ``meta["notes"]`` and ``meta["inductor"]``):
- **line map**: a wrapper line is charged to the stack trace of the line map region holding it
  (Inductor's choice: the fused group's last FX node in graph order). A C++ kernel's call is
  written when Inductor flushes its kernel group, after the next node's region began: it takes
  the region of the line that last assigned one of its buffer arguments (its output). The frames from the
  innermost Python frame of the stack trace's first function (dynamo's frame of the compiled
  function) down to the wrapper frame are replaced by that stack trace; without such a frame, the
  torch frames right above the wrapper frame are (dynamo, AOT autograd, Inductor's runtime).
- **kernel name kept**: the op frame names what the line calls (``cpp_fused_relu_0``,
  ``triton_poi_fused_mul_1``, ``extern_kernels.addmm``; ``wrapper`` for the wrapper's own lines:
  allocations, asserts), ``[compiled backward]`` for a backward graph's module.
- **fused kernels named, never split**: samples and GPU time stay whole on the line map's line;
  the op frame lists every other source line Inductor recorded for the kernel (``(fused:
  model.py:9, …)``): the post-grad nodes of its ``Source node to ATen node mapping`` comment
  (Triton kernels) or its call site's ``Source Nodes`` comment (extern kernels). A fused kernel
  whose other lines Inductor did not record (C++ kernels: no comment) says ``(fused: last node's line)``.
"""

from __future__ import annotations

import bisect
import re
from dataclasses import dataclass, field

from stacklens.cct import Frame
from stacklens.records.agent import InductorRecord
from stacklens.textsafe import MAX_FRAME_FILE, MAX_FRAME_NAME, clip_text

Path = tuple[Frame, ...]

COMPILED_NOTE = ("inductor: a line of torch.compile's generated wrapper is charged to the model's stack "
                 "trace from Inductor's line map (the fused group's last FX node), under op:[compiled] "
                 "KERNEL; a fused kernel's other recorded source lines are named in that frame, never "
                 "split (meta inductor)")
MAX_MODULES = 4096
MAX_LINES = 1 << 20           # kernel lines kept over all modules
MAX_PENDING = 64              # modules whose parts are still arriving
MAX_FUSED_NAMED = 8

_TRACE = re.compile(r'^\s*File "(.+)", line (\d+), in (.+)$')
_DEF = re.compile(r"^(\w+) = async_compile\.\w+\(")
_CALL = re.compile(r"^\s+(\w+)(?:\.run)?\(")
_EXTERN = re.compile(r"\bextern_kernels\.(\w+)\(")
_FALLBACK = re.compile(r"\b(?:torch\.ops\.|aten\.)((?:aten\.)?\w+)\.\w+\(")
_ASSIGN = re.compile(r"^\s+(buf\w+) = ")
_BUF = re.compile(r"\b(buf\w+)\b")
_SOURCE_NODES = re.compile(r"Source Nodes: \[([^\]]*)\]")
_MAPPING = re.compile(r"^#\s+(\w+) => (.+)$")
_SUBGRAPH_NODE = re.compile(r"^#\s+%(\w+) : .*= call_function\[")
_BODY = re.compile(r"^\s*def (?:call|partition_\d+)\(")


def parse_trace(text: str) -> Path:
    """An FX ``stack_trace`` (traceback text) -> its python frames, outermost first; file and
    function cut and escaped like every frame from a target."""
    out = []
    for line in text.splitlines():
        m = _TRACE.match(line)
        if m:
            out.append(Frame.python(clip_text(m.group(1), MAX_FRAME_FILE), clip_text(m.group(3).strip(), MAX_FRAME_NAME),
                                    int(m.group(2))))
    return tuple(out)


def _names(s: str) -> list[str]:
    return [n.strip() for n in s.split(",") if n.strip()]


@dataclass(frozen=True, slots=True)
class WrapperMap:
    """The mapping of one wrapper module: regions of the line map and the kernel lines."""
    path: str
    backward: bool
    starts: tuple[int, ...]                 # first line of each region, ascending
    stacks: tuple[Path, ...]                # the region's stack trace frames
    # line -> (kernel, other source lines, the line whose region it belongs to)
    kernels: dict[int, tuple[str, tuple[tuple[str, int], ...], int]]

    def at(self, line: int) -> tuple[Path, str, tuple[tuple[str, int], ...]] | None:
        """(stack trace frames, kernel name, other (file, line)s the kernel fused) of a wrapper
        line; None before the first region or where the region has no stack trace."""
        kernel, others, at = self.kernels.get(line, ("wrapper", (), line))
        i = bisect.bisect_right(self.starts, at) - 1
        if i < 0 or not self.stacks[i]:
            return None
        return self.stacks[i], kernel, others


def build_map(path: str, lines, regions, traces, nodes) -> WrapperMap:
    """The pure mapping: a module's wrapper lines (number, text), line map regions (first line,
    trace index), stack traces and post-grad node locations -> `WrapperMap`."""
    locs = {n: (f, ln) for n, f, ln, _fn in nodes}
    stacks = [parse_trace(t) for t in traces]
    regs = sorted((ln, stacks[i] if i < len(stacks) else ()) for ln, i in regions)
    first = regs[0][0] if regs else 1 << 62
    no_map = not regs                        # rule "no line map": each call its own node's line
    if no_map:
        first = next((ln for ln, text in sorted(lines) if _BODY.match(text)), 1 << 62)
        funcs = {n: fn for n, _f, _ln, fn in nodes}
        extern_seen: dict[str, int] = {}
    backward = False
    defined: dict[str, list[str]] = {}       # kernel -> source node names of its definition's comment
    comment: list[str] = []                  # the comment block just read
    kernels = {}
    assigned: dict[str, int] = {}            # buffer -> line of its latest assignment in `call`
    for ln, text in sorted(lines):
        s = text.strip()
        if s.startswith("#"):
            if s.startswith("# AOT ID:") and "backward" in s:
                backward = True
            comment.append(s)
            continue
        if ln < first:
            m = _DEF.match(text)
            if m:
                defined[m.group(1)] = _comment_nodes(comment, mapping=True)
            comment = []
            continue
        names = _comment_nodes(comment, mapping=False)
        comment = []
        a = _ASSIGN.match(text)
        if a:
            assigned[a.group(1)] = ln
        m = _CALL.match(text)
        kernel = None
        if m and m.group(1) in defined:
            kernel = m.group(1)
            names = defined[kernel] + names
        else:
            e = _EXTERN.search(text) or _FALLBACK.search(text)
            if e:
                kernel = ("extern_kernels." if e.re is _EXTERN else "aten.") + e.group(1).removeprefix("aten.")
        if kernel is None:
            continue
        others = tuple(dict.fromkeys(locs[n] for n in names if n in locs))
        if no_map:
            own = _own_node(kernel, kernel in defined, names, locs, extern_seen)
            regs.append((ln, () if own is None else (Frame.python(clip_text(locs[own][0], MAX_FRAME_FILE),
                                                                  clip_text(funcs[own], MAX_FRAME_NAME),
                                                                  locs[own][1]),)))
        at = ln
        if kernel.startswith("cpp_"):
            # Inductor flushes C++ kernels late (after the next node's region began): the region
            # of the kernel's own node is where its latest argument buffer (its output) was assigned
            at = max((assigned[b] for b in _BUF.findall(text) if assigned.get(b, ln) < ln), default=ln)
        kernels[ln] = (clip_text(kernel, MAX_FRAME_NAME), others, at)
    return WrapperMap(path, backward, tuple(r[0] for r in regs), tuple(r[1] for r in regs), kernels)


def _own_node(kernel: str, triton: bool, names: list[str], locs: dict, seen: dict[str, int]) -> str | None:
    """Rule "no line map": the post-grad node a kernel call is charged to. A Triton kernel: the
    last node of its definition's subgraph (Inductor's "last node" rule) that has a source line. A
    library call (``extern_kernels.mm``, ``aten._scaled_dot_product_…``): the node of its op that
    its ``Source Nodes`` comment names last (``[permute_33, mm_1]``: a backward graph's own
    nodes, called out of their order); else, the comment naming the model's own nodes instead
    (``[layer_norm, linear]``), FX names a graph's nodes of one op ``mm``, ``mm_1``, … in graph
    order and the wrapper calls them in that order, so the k-th call of an op is the node of that
    op named for k; else its own nodes' last located one."""
    if not triton:
        op = kernel.rpartition(".")[2]
        k = seen.get(op, 0)
        seen[op] = k + 1
        own = next((n for n in reversed(names) if n in locs and (n == op or n.startswith(op + "_"))), None)
        if own is not None:
            return own
        name = op if k == 0 else f"{op}_{k}"
        if name in locs:
            return name
    return next((n for n in reversed(names) if n in locs), None)


def _comment_nodes(comment: list[str], mapping: bool) -> list[str]:
    """Node names of a kernel's comment block: the post-grad nodes of ``Source node to ATen node
    mapping`` (right of ``=>``), and the ``Source Nodes: [...]`` names (post-grad names where
    Inductor wrote those; a name no post-grad node has is ignored)."""
    out: list[str] = []
    in_mapping = False
    for s in comment:
        m = _SOURCE_NODES.search(s)
        if m:
            out.extend(_names(m.group(1)))
        elif mapping and (g := _SUBGRAPH_NODE.match(s)):
            out.append(g.group(1))           # the kernel's post-grad subgraph, printed in its comment
        elif mapping and s.startswith("# Source node to ATen node mapping"):
            in_mapping = True
        elif in_mapping:
            mm = _MAPPING.match(s)
            if mm:
                out.extend(_names(mm.group(2)))
            else:
                in_mapping = False
    return out


def op_label(m: WrapperMap, kernel: str, stack: Path, others: tuple[tuple[str, int], ...]) -> str:
    """The op frame's name: ``[compiled] KERNEL`` and, for a fused kernel, its other lines."""
    head = ("[compiled backward] " if m.backward else "[compiled] ") + kernel
    own = (stack[-1].file, stack[-1].line)
    rest = [o for o in others if o != own]
    if rest:
        named = ", ".join(f"{f.rpartition('/')[2]}:{ln}" for f, ln in rest[:MAX_FUSED_NAMED])
        more = f", +{len(rest) - MAX_FUSED_NAMED}" if len(rest) > MAX_FUSED_NAMED else ""
        return f"{head} (fused: {named}{more})"
    if "_fused_" in kernel and not others:
        return head + " (fused: last node's line)"
    return head


@dataclass
class _Parts:
    parts: int
    got: dict = field(default_factory=dict)


class InductorIndex:
    """The wrapper maps of one process; owned by the aggregation thread. `add` takes the agent's
    records (True when a module became complete: paths spliced before may be rewritten now);
    `rewrite` maps a path through a known wrapper."""

    def __init__(self) -> None:
        self.modules: dict[str, WrapperMap] = {}
        self._pending: dict[str, _Parts] = {}
        self._lines = 0
        self._ops: dict[tuple[str, int], Frame] = {}
        self._by_kernel: dict[str, list[str]] | None = None      # Triton kernel -> modules calling it
        self.stats = {"modules": 0, "kernel_lines": 0, "refused": 0}

    def add(self, rec: InductorRecord) -> bool:
        if rec.path in self.modules:
            return False
        p = self._pending.get(rec.path)
        if p is None or p.parts != rec.parts:
            if len(self._pending) >= MAX_PENDING:
                self._pending.pop(next(iter(self._pending)))
            p = self._pending[rec.path] = _Parts(rec.parts)
        p.got[rec.part] = rec
        if len(p.got) < p.parts:
            return False
        del self._pending[rec.path]
        recs = [p.got[i] for i in range(p.parts)]
        m = build_map(rec.path, [x for r in recs for x in r.lines], [x for r in recs for x in r.regions],
                      [x for r in recs for x in r.traces], [x for r in recs for x in r.nodes])
        if len(self.modules) >= MAX_MODULES or self._lines + len(m.kernels) > MAX_LINES:
            self.stats["refused"] += 1
            return False
        self.modules[rec.path] = m
        self._by_kernel = None
        self._lines += len(m.kernels)
        self.stats["modules"] = len(self.modules)
        self.stats["kernel_lines"] = self._lines
        return True

    def rewrite(self, path: Path) -> Path:
        """`path` with its innermost wrapper frame (a ``call`` of a known module) replaced by the
        model's stack trace and the op frame (module docstring); unchanged otherwise."""
        hit = self._hit(path)
        if hit is None:
            return path
        w, stack, op = hit
        return path[:_cut(path, w, stack[0])] + stack + (op,) + path[w + 1:]

    def tail(self, py) -> Path | None:
        """The model's stack trace and the op frame of the innermost wrapper frame among the
        python frames `py` (a backward event's: they follow its autograd head); None if none."""
        hit = self._hit(py)
        return None if hit is None else hit[1] + (hit[2],)

    def _hit(self, path) -> tuple[int, Path, Frame] | None:
        mods = self.modules
        for w in range(len(path) - 1, -1, -1):
            f = path[w]
            if f.kind == "python" and f.file in mods:
                break
        else:
            return None
        if f.name != "call" and not f.name.endswith(".call"):
            return None
        m = mods[f.file]
        hit = m.at(f.line)
        if hit is None:
            return None
        stack, kernel, others = hit
        key = (f.file, f.line)
        op = self._ops.get(key)
        if op is None:
            op = Frame.op(op_label(m, kernel, stack, others))
            if len(self._ops) < MAX_LINES:
                self._ops[key] = op
        return w, stack, op

    def meta(self) -> dict[str, int]:
        return dict(self.stats)

    # ---- CUDA-graph replays of compiled code (daemon/join/graphs.py) --------------------------
    def best_module(self, kernels: list[str]) -> str | None:
        """The module whose Triton kernels most of `kernels` (a graph replay's names) are; the
        newest on a tie; None if no name is one of theirs."""
        if self._by_kernel is None:
            by: dict[str, list[str]] = {}
            for path, m in self.modules.items():
                for name in {k for k, _o, _a in m.kernels.values() if is_triton(k)}:
                    by.setdefault(name, []).append(path)
            self._by_kernel = by
        score: dict[str, int] = {}
        for k in set(kernels):
            for path in self._by_kernel.get(k, ()):
                score[path] = score.get(path, 0) + 1
        if not score:
            return None
        order = {p: i for i, p in enumerate(self.modules)}
        return max(score, key=lambda p: (score[p], order[p]))

    def calls(self, path: str) -> tuple[list[tuple[str, bool]], list[Path | None]]:
        """A module's kernel calls in the order ``call`` makes them: [(kernel, is Triton)], and
        for each the model's stack trace and op frame its line is charged to (None: no trace)."""
        m = self.modules[path]
        calls, tails = [], []
        for line in sorted(m.kernels):
            kernel = m.kernels[line][0]
            calls.append((kernel, is_triton(kernel)))
            hit = m.at(line)
            if hit is None:
                tails.append(None)
                continue
            stack, kernel, others = hit
            tails.append(stack + (Frame.op(op_label(m, kernel, stack, others)),))
        return calls, tails


def is_triton(kernel: str) -> bool:
    """A wrapper's own kernel (Triton on GPU; its launch keeps the name), not a library call."""
    return not kernel.startswith(("extern_kernels.", "aten.", "cpp_"))


def _cut(path: Path, w: int, top: Frame) -> int:
    """Where the replaced frames begin (module docstring, rule "line map")."""
    for i in range(w - 1, -1, -1):
        f = path[i]
        if f.kind == "python" and f.file == top.file and (f.name == top.name or f.name.endswith("." + top.name)):
            return i
    j = w
    while j > 0 and path[j - 1].kind == "python" and "/torch/" in path[j - 1].file:
        j -= 1
    return j
