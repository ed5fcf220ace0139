"""torch.compile (Inductor) support of the agent: what ties generated code to the model's lines.

Stdlib only; never imports torch: it reads ``torch._inductor.codecache.PyCodeCache`` from
``sys.modules`` once the target has imported it (i.e. compiled something). Runs on the agent
thread. Cost: a length check per flush; per new generated module one read of its file (at most
MAX_FILE bytes) and, at most every GC_SCAN_S, one ``gc.get_referrers(CompiledFxGraph)`` scan for
its graph (the instances of that one class, not every object of the heap: see ``_scan_graphs``;
at most 0.1% of the job's time, and none where the heap is over ``heapscan.MAX_SCAN_BLOCKS``).

What it sends (wire kind ``inductor``, validated by ``stacklens.inject.channel.inductor``; the
mapping is built by the daemon, ``daemon/join/compiled.py``), per generated wrapper module, as rows:
- ``["T", stack_trace]``: the distinct FX ``stack_trace`` strings of Inductor's line map
  (``PyCodeCache.linemaps[path]``, kept by default for every module it loads: for each region of
  the wrapper, the stack trace of the last FX node of the scheduler node generated there);
- ``["M", first_line, trace index]``: the regions;
- ``["N", node, file, line, function]``: the post-grad FX nodes' source lines, from
  ``CompiledFxGraph.inductor_post_grad_graph_str`` (its ``# File:`` comments), when found;
- ``["S", line number, text]``: the wrapper's comment lines, kernel definition lines and the
  lines from the first region on (the ``call`` body), where the daemon finds which kernel each line calls and the
  ``Source Nodes`` comments Inductor wrote for it.
A wrapper without a line map (torch 2.11 keeps none for the graph-partitioned wrappers of
cudagraph trees) is sent without T and M rows; other modules without one (a Triton kernel's own
module) are not sent.
Rows of one module travel in parts of at most MSG_BUDGET bytes.
"""

import json
import os
import sys
import time

# a module of the agent ("heapscan"), through the agent package (loaded before it)
_sub = sys.modules[__name__.rpartition(".")[0]]._sub

CODECACHE = "torch._inductor.codecache"
MAX_FILE = 32 << 20          # larger wrapper files are not read (a note says so)
MAX_MODULES = 4096           # modules remembered as sent
MAX_TEXT = 4096              # characters of one row's string (the daemon takes no more)
MAX_TRACE = 8192
MSG_BUDGET = 400_000         # bytes of rows per message (wire.MAX_FRAME is 1 MiB)
MAX_PARTS = 256
GC_SCAN_S = 10.0
SCAN_DUTY = 1000             # ... and at least this many times as long as the last walk took: the
                             # walks stop the job's threads for at most 0.1% of its time


def codecache_ready():
    """PyCodeCache, if the target imported torch._inductor.codecache completely; else None."""
    mod = sys.modules.get(CODECACHE)
    if mod is None:
        return None
    spec = getattr(mod, "__spec__", None)
    if spec is not None and getattr(spec, "_initializing", False):
        return None
    return getattr(mod, "PyCodeCache", None)


def _key(path):
    """The PyCodeCache key of a wrapper module: its file's stem (CompiledFxGraph.cache_key)."""
    return os.path.splitext(os.path.basename(path))[0]


def post_grad_nodes(graph_str):
    """``# File: F:L in FUNC, code: …`` comments of a printed FX graph and the node lines under
    each -> [(node, file, line, func)]."""
    out = []
    loc = None
    for raw in graph_str.splitlines():
        s = raw.strip()
        if s.startswith("# File: "):
            head = s[8:].split(", code: ", 1)[0]
            where, _, func = head.rpartition(" in ")
            file, _, line = where.rpartition(":")
            loc = (file, int(line), func) if line.isdigit() and file else None
        elif loc is not None and s and not s.startswith("#"):
            name = s.split(":", 1)[0].split("=", 1)[0].strip()
            if name.isidentifier():
                out.append((name, loc[0], loc[1], loc[2]))
        elif not s:
            loc = None
    return out


def wrapper_rows(text, starts):
    """The ``S`` rows of a wrapper's source: comment lines, kernel definitions (``NAME =
    async_compile.…``) and every non-blank line from the first region start on (without a line
    map: from the first ``def call(`` or ``def partition_N(``, where the kernel calls are)."""
    lines = text.splitlines()
    if starts:
        first = min(starts)
    else:
        first = next((i for i, line in enumerate(lines, 1) if line.startswith(("def call(", "def partition_"))
                      or line.lstrip().startswith("def call(")), len(lines) + 1)
    rows = []
    for i, line in enumerate(lines, 1):
        s = line.strip()
        if s and (i >= first or s.startswith("#") or (line[0] != " " and " = async_compile." in line)):
            rows.append(["S", i, line[:MAX_TEXT]])
    return rows


def module_rows(text, lines, traces, nodes):
    """All rows of one module (see the module docstring)."""
    index = {}
    rows = []
    for t in traces:
        if t not in index:
            index[t] = len(index)
            rows.append(["T", str(t)[:MAX_TRACE]])
    for ln, t in zip(lines, traces):
        if type(ln) is int and ln > 0:
            rows.append(["M", ln, index[t]])
    for n, f, ln, fn in nodes:
        rows.append(["N", n[:256], f[:MAX_TEXT], ln, fn[:256]])
    rows.extend(wrapper_rows(text, [ln for ln in lines if type(ln) is int]))
    return rows


def chunks(rows, budget=MSG_BUDGET):
    """Rows in lists of at most `budget` encoded bytes (a row is far smaller than a frame)."""
    out, cur, size = [], [], 0
    for r in rows:
        n = len(json.dumps(r, ensure_ascii=False).encode("utf-8", "replace")) + 1
        if cur and size + n > budget:
            out.append(cur)
            cur, size = [], 0
        cur.append(r)
        size += n
    out.append(cur)
    return out


class InductorWatcher:
    """Started by the agent once the target has imported Inductor's code cache; polled on the
    agent thread. Sends each generated module once; a part the outbox refuses is retried."""

    def __init__(self, send, note, clock=time.monotonic):
        self.send = send
        self.note = note
        self.clock = clock
        self.sent = set()
        self.pending = []              # messages the outbox refused, in order
        self.todo = []                 # modules seen, not yet sent
        self.graphs = {}               # cache key -> post-grad graph string
        self.last_scan = None
        self.scan_skipped = 0          # scans not made: the heap was over heapscan's bound
        self.walk_s = 0.0              # how long the last heap walk took (the next waits 1000x that)
        self.seen = 0
        self.modules_sent = 0
        self.dropped = 0

    def poll(self):
        while self.pending and self.send(self.pending[0]):
            self.pending.pop(0)
        if self.pending:
            return
        cache = codecache_ready()
        linemaps = getattr(cache, "linemaps", None) if cache is not None else None
        if type(linemaps) is not dict:
            return
        if len(linemaps) != self.seen:
            self.seen = len(linemaps)
            self.todo.extend(p for p in list(linemaps) if type(p) is str and p not in self.sent and p not in self.todo)
        if not self.todo:
            return
        # a module's graph is looked for by a scan after it appeared (rate-limited: retried later)
        if any(_key(p) not in self.graphs for p in self.todo) and not self._scan_graphs():
            return
        todo, self.todo = self.todo, []
        for path in todo:
            if len(self.sent) >= MAX_MODULES:
                return
            self.sent.add(path)
            try:
                self._module(path, linemaps.get(path))
            except BaseException as e:
                self.dropped += 1
                self.note("warning", f"inductor: generated module {path[:200]} unreadable: {type(e).__name__}: {e}")

    def _scan_graphs(self):
        """The post-grad graphs of CompiledFxGraph objects, by the key of their wrapper module;
        one scan at most every GC_SCAN_S, and at most SCAN_DUTY times as often as the last walk
        took. True if it scanned (or found the walk over heapscan's bound).

        A guest never changes when a target's object dies. ``gc.get_objects()`` did: its list held
        every tensor of the process while this thread walked it, so a tensor the target dropped
        meanwhile died later, on this thread, and cudagraph trees, which check that the inputs
        freed while recording a graph are freed again at replay, stopped the job (measured on the
        H200: "input tensor deallocate during graph recording that did not occur during replay").
        ``gc.get_referrers(cls)`` returns only what refers to the class: its instances (a heap
        type's instances visit their type) and a few long-lived containers (its module's dict,
        subclasses' bases); only the instances' two strings are kept."""
        now = self.clock()
        if self.last_scan is not None and now - self.last_scan < max(GC_SCAN_S, SCAN_DUTY * self.walk_s):
            return False
        self.last_scan = now
        mod = sys.modules.get("torch._inductor.output_code")
        cls = getattr(mod, "CompiledFxGraph", None) if mod is not None else None
        if not isinstance(cls, type):
            return True
        heapscan = _sub("heapscan")
        t0 = time.perf_counter()
        found = heapscan.instances((cls,))
        self.walk_s = time.perf_counter() - t0
        if found is None:          # the walk would stop the job's threads too long
            if not self.scan_skipped:
                self.note("info", f"inductor: post-grad graphs not read: the heap is over "
                          f"{heapscan.MAX_SCAN_BLOCKS} blocks (a walk would stop the job's threads for "
                          "about a second); kernels are charged by the wrapper's line map")
            self.scan_skipped += 1
            return True
        try:
            for o in found:
                key, s = getattr(o, "cache_key", None), getattr(o, "inductor_post_grad_graph_str", None)
                if type(key) is str and type(s) is str and len(self.graphs) < MAX_MODULES:
                    self.graphs[key] = s
        finally:
            del found
        return True

    def _module(self, path, linemap):
        lines, traces = (), ()
        if linemap and len(linemap) == 2:
            lines, traces = tuple(linemap[0]), tuple(str(t) if t else "" for t in linemap[1])
        # no line map (torch 2.11's graph-partitioned wrappers of cudagraph trees keep none): the
        # daemon charges each kernel call to its own nodes' lines (daemon/join/compiled.py)
        if os.path.getsize(path) > MAX_FILE:
            self.note("warning", f"inductor: generated module {path[:200]} over {MAX_FILE} bytes not read")
            return
        with open(path, encoding="utf-8", errors="replace") as fh:
            text = fh.read()
        if not lines and "def call(" not in text:
            return                                   # a Triton kernel's own module, not a wrapper
        key = _key(path)
        nodes = post_grad_nodes(self.graphs[key]) if key in self.graphs else []
        parts = chunks(module_rows(text, lines, traces, nodes))
        if len(parts) > MAX_PARTS:
            self.dropped += 1
            self.note("warning", f"inductor: generated module {path[:200]} too large to send ({len(parts)} parts)")
            return
        for i, rows in enumerate(parts):
            msg = {"t": "inductor", "path": path[:MAX_TEXT], "part": i, "parts": len(parts), "r": rows}
            if self.pending or not self.send(msg):
                if len(self.pending) >= MAX_PARTS:
                    self.dropped += 1
                    continue
                self.pending.append(msg)
        self.modules_sent += 1

    def stats(self):
        return {"inductor_modules": self.modules_sent, "inductor_dropped": self.dropped}
