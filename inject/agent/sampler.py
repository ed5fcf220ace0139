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
"""

import sys
import threading
import time


class Sampler:
    MAX_CACHED = 4096      # (code, offset) entries
    MAX_CODES = 256        # code objects kept alive by the cache (a generated forward() can be MBs)

    def __init__(self, hz=100.0, max_depth=128, max_overhead=0.02, skip_idents=()):
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
        frames = sys._current_frames()
        try:
            for ident, f in frames.items():
                if ident in skip:
                    continue
                stack = []
                push = stack.append
                n = depth
                while f is not None and n:
                    co = f.f_code
                    key = (id(co), f.f_lasti)
                    fr = cache.get(key)
                    if fr is None:
                        if len(cache) >= self.MAX_CACHED or len(codes) >= self.MAX_CODES:
                            cache.clear()
                            codes.clear()
                        fr = cache[key] = (co.co_filename, getattr(co, "co_qualname", co.co_name), f.f_lineno or 0)
                        codes[key[0]] = co
                    push(fr)
                    f = f.f_back
                    n -= 1
                truncated = f is not None
                stack.reverse()
                t = threads.get(ident)
                out.append(((t.native_id or 0) if t is not None else 0, now, tuple(stack), truncated))
        finally:
            del frames, f   # never keep frames (and their locals) alive
        self.samples += 1
        cost = time.perf_counter() - t0
        self.cost_ewma = cost if self.samples == 1 else 0.9 * self.cost_ewma + 0.1 * cost
        self._adapt()
        return out

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
