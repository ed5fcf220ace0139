"""Python-frame sampler over ``sys._current_frames()`` (all threads), stdlib only.

Runs on the agent's own thread and holds the GIL while it walks the stacks: ~3 µs for one shallow
thread and ~8 µs for a 45-frame stack with warm caches, 2–3x that 10 ms apart inside a busy target
(docs/benchmarks/agent-sampler.md). The rate adapts: if sampling costs more than ``max_overhead``
of one CPU, the interval grows (down to 1 Hz); it returns to the configured rate when cheap again.

A frame costs one dict lookup: ``(filename, qualname, lineno)`` is cached per (code object,
instruction offset), so the names and ``f_lineno`` (a line-table scan) are computed once per call
site, and equal frames are one shared tuple. The cache keys on ``id(code)`` (hashing a code
object hashes its constants: ~0.2–0.4 µs) and keeps the code objects it names alive, so an id
cannot be reused while its entry exists; it holds no frames, and is cleared before it exceeds
``MAX_CACHED`` entries or ``MAX_CODES`` code objects (what it keeps alive is bounded by count:
generated code such as torch.fx's ``forward`` can be large).

Module calls (the model view, ``cct/modelview.py``): a frame of a ``forward(self, ...)`` whose
``self`` is a ``torch.nn.Module`` gets the instance's attribute path from the outermost module on
its stack and its class: ``(file, qualname, line, "transformer.h.3.attn", "GPT2Attention")``. The
paths come from one walk of the outermost module's ``_modules`` dicts (what ``named_modules()``
walks; dict reads only, no code of the target runs), cached per root by id with weak references
that tell a reused id apart, at most ``MAX_MODULES`` per root and ``MAX_ROOTS`` roots, re-walked at
most once a second when a module is not found (a model changed after its first sample). Reading
``self`` costs a ``frame.f_locals``: a proxy from 3.13 (nothing copied, nothing held). Before 3.13
it copies the frame's locals into the frame's own dict (what debuggers read), which holds every
local until the next read or the call's return: a tensor the target rebinds inside a ``forward``
would then live on, and a guest never changes when a target's object dies. So module paths are on
by default from 3.13 only (``MODULE_PATHS_DEFAULT``); before it frames keep their qualname
(``GPT2Attention.forward``) and the agent says so; ``module_paths=True`` asks for them anyway.
"""

import sys
import threading
import time
import weakref

MODULE_PATHS_DEFAULT = sys.version_info >= (3, 13)   # f_locals is a proxy, not a copy (PEP 667)


class Sampler:
    MAX_CACHED = 4096      # (code, offset) entries
    MAX_CODES = 256        # code objects kept alive by the cache (a generated forward() can be MBs)
    MAX_ROOTS = 8          # outermost modules whose attribute paths are cached
    MAX_MODULES = 10000    # modules named per root; deeper ones go by class alone
    MAX_PATH = 512         # characters of an attribute path (the daemon keeps at most that much)
    MAX_NAMED = 4096       # (frame, path) tuples interned

    def __init__(self, hz=100.0, max_depth=128, max_overhead=0.02, skip_idents=(),
                 module_paths=MODULE_PATHS_DEFAULT):
        self.module_paths = bool(module_paths)
        self.base_interval = 1.0 / max(0.1, min(float(hz), 1000.0))
        self.interval = self.base_interval
        self.max_depth = max(1, min(int(max_depth), 256))
        self.max_overhead = max_overhead
        self.skip = set(skip_idents)
        self.cost_ewma = 0.0          # seconds per sample
        self.samples = 0
        self.adaptations = 0
        self._frames = {}             # (id(code), f_lasti) -> (filename, qualname, lineno)
        self._codes = {}              # id(code) -> code: keeps every id in _frames unique
        self._forwards = set()        # ids (in _codes) of `forward(self, ...)` code objects
        self._module_cls = None       # torch.nn.Module, once torch is imported
        self._is_module = {}          # type -> bool
        self._roots = {}              # id(root) -> (weakref(root), {id(m): ((path, class), weakref(m))}, walked at)
        self._named = {}              # (frame tuple, (path, class)) -> the shared 5-tuple
        self._rng = (time.monotonic_ns() ^ (id(self) << 7)) & 0xFFFFFFFF or 1

    def next_interval(self):
        """The interval, jittered uniformly in [0.5, 1.5)x: a fixed period aliases with periodic
        workloads (a 10 ms training step sampled every 10 ms always lands in the same place)."""
        x = self._rng
        x ^= (x << 13) & 0xFFFFFFFF
        x ^= x >> 17
        x ^= (x << 5) & 0xFFFFFFFF
        self._rng = x
        return self.interval * (0.5 + x / 4294967296.0)

    def sample(self):
        """One sample of every thread: list of (native tid, t_ns, frames outermost first, truncated)."""
        t0 = time.perf_counter()
        now = time.monotonic_ns()
        cache = self._frames
        codes = self._codes
        skip = self.skip
        # the live Thread objects by ident (an ident is reused as soon as a thread is joined, so a
        # cache of ident -> native id would name a dead thread); foreign threads that threading
        # never saw are tid 0
        threads = getattr(threading, "_active", None) or {t.ident: t for t in threading.enumerate()}
        depth = self.max_depth
        out = []
        f = None
        forwards = self._forwards
        frames = sys._current_frames()
        calls = None
        try:
            for ident, f in frames.items():
                if ident in skip:
                    continue
                stack = []
                push = stack.append
                calls = []                # (index from the innermost, self) of module forwards
                n = depth
                while f is not None and n:
                    co = f.f_code
                    key = (id(co), f.f_lasti)
                    fr = cache.get(key)
                    if fr is None:
                        if len(cache) >= self.MAX_CACHED or len(codes) >= self.MAX_CODES:
                            cache.clear()
                            codes.clear()
                            forwards.clear()
                        fr = cache[key] = (co.co_filename, getattr(co, "co_qualname", co.co_name), f.f_lineno or 0)
                        codes[key[0]] = co
                        if (self.module_paths and co.co_name == "forward" and co.co_argcount
                                and co.co_varnames[0] == "self"):
                            forwards.add(key[0])
                    if key[0] in forwards:
                        obj = self._module_self(f)
                        if obj is not None:
                            calls.append((len(stack), obj))
                    push(fr)
                    f = f.f_back
                    n -= 1
                truncated = f is not None
                if calls:
                    try:
                        self._name_calls(stack, calls)
                    except Exception:     # a module we cannot name stays a plain frame
                        pass
                    calls = None
                stack.reverse()
                t = threads.get(ident)
                out.append(((t.native_id or 0) if t is not None else 0, now, tuple(stack), truncated))
        finally:
            del frames, f, calls   # never keep frames, their locals or modules alive
        self.samples += 1
        cost = time.perf_counter() - t0
        self.cost_ewma = cost if self.samples == 1 else 0.9 * self.cost_ewma + 0.1 * cost
        self._adapt()
        return out

    def _module_self(self, f):
        """The frame's ``self`` if it is a torch.nn.Module, else None; never raises."""
        try:
            obj = f.f_locals.get("self")
            if obj is None:
                return None
            cls = type(obj)
            ok = self._is_module.get(cls)
            if ok is None:
                base = self._module_cls
                if base is None:
                    mod = sys.modules.get("torch.nn.modules.module")
                    base = self._module_cls = mod.__dict__.get("Module") if mod is not None else None
                    if not isinstance(base, type):
                        self._module_cls = None
                        return None
                if len(self._is_module) >= 256:
                    self._is_module.clear()
                ok = self._is_module[cls] = issubclass(cls, base)
            return obj if ok else None
        except Exception:
            return None

    def _name_calls(self, stack, calls):
        """Replace the module forwards' frames in ``stack`` (innermost first) by 5-tuples with
        their attribute path below the outermost module of the stack and their class."""
        root = calls[-1][1]
        named = self._paths(root)
        interned = self._named
        for i, obj in calls:
            entry = named.get(id(obj))
            if (entry is None or entry[1]() is not obj) and obj is not root and self._rewalk(root):
                named = self._roots[id(root)][1]
                entry = named.get(id(obj))
            tail = entry[0] if entry is not None and entry[1]() is obj else ("", type(obj).__name__)
            key = (stack[i], tail)
            fr = interned.get(key)
            if fr is None:
                if len(interned) >= self.MAX_NAMED:
                    interned.clear()
                fr = interned[key] = stack[i] + tail
            stack[i] = fr

    def _paths(self, root):
        entry = self._roots.get(id(root))
        if entry is not None and entry[0]() is root:
            return entry[1]
        if len(self._roots) >= self.MAX_ROOTS:
            self._roots.clear()
        named = self._walk(root)
        self._roots[id(root)] = (weakref.ref(root), named, time.monotonic())  # nn.Module has __weakref__
        return named

    def _rewalk(self, root):
        """Walk ``root`` again if its map is older than a second (a model changed since)."""
        entry = self._roots.get(id(root))
        if entry is None or time.monotonic() - entry[2] < 1.0:
            return False
        self._roots[id(root)] = (entry[0], self._walk(root), time.monotonic())
        return True

    def _walk(self, root):
        """{id(module): ((attribute path, class name), weakref)}, preorder as named_modules()."""
        named = {}
        todo = [("", root)]
        getdict = object.__getattribute__
        while todo and len(named) < self.MAX_MODULES:
            path, m = todo.pop()
            if id(m) in named:
                continue
            try:
                named[id(m)] = ((path, type(m).__name__), weakref.ref(m))
                subs = getdict(m, "__dict__").get("_modules")
            except Exception:
                continue
            if type(subs) is not dict:
                continue
            kids = [(f"{path}.{k}" if path else k, v) for k, v in subs.items()
                    if type(k) is str and v is not None]
            todo.extend(kv for kv in reversed(kids) if len(kv[0]) <= self.MAX_PATH)
        return named

    def _adapt(self):
        load = self.cost_ewma / self.interval
        if load > self.max_overhead and self.interval < 1.0:
            self.interval = min(1.0, self.interval * 1.5)
            self.adaptations += 1
        elif load < self.max_overhead / 4 and self.interval > self.base_interval:
            self.interval = max(self.base_interval, self.interval / 1.5)
            self.adaptations += 1

    @property
    def hz(self):
        return 1.0 / self.interval
