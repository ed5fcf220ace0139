"""Python-frame sampler over ``sys._current_frames()`` (all threads), stdlib only.

Runs on the agent's own thread and holds the GIL while it walks the stacks (~10–100 µs per sample
for a few shallow threads). The rate adapts: if sampling costs more than ``max_overhead`` of one
CPU, the interval grows (down to 1 Hz); it returns to the configured rate when cheap again.
"""

import sys
import threading
import time


class Sampler:
    def __init__(self, hz=100.0, max_depth=128, max_overhead=0.02, skip_idents=()):
        self.base_interval = 1.0 / max(0.1, min(float(hz), 1000.0))
        self.interval = self.base_interval
        self.max_depth = max(1, min(int(max_depth), 256))
        self.max_overhead = max_overhead
        self.skip = set(skip_idents)
        self.cost_ewma = 0.0          # seconds per sample
        self.samples = 0
        self.adaptations = 0
        self._natives = {}
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

    def _native_id(self, ident):
        nid = self._natives.get(ident)
        if nid is None:
            self._natives = {t.ident: (t.native_id or 0) for t in threading.enumerate()}
            nid = self._natives.get(ident, 0)
        return nid

    def sample(self):
        """One sample of every thread: list of (native tid, t_ns, frames outermost first, truncated)."""
        t0 = time.perf_counter()
        now = time.monotonic_ns()
        out = []
        f = None
        frames = sys._current_frames()
        try:
            depth = self.max_depth
            for ident, f in frames.items():
                if ident in self.skip:
                    continue
                stack = []
                while f is not None and len(stack) < depth:
                    co = f.f_code
                    stack.append((co.co_filename, getattr(co, "co_qualname", co.co_name), f.f_lineno or 0))
                    f = f.f_back
                truncated = f is not None
                stack.reverse()
                out.append((self._native_id(ident), now, tuple(stack), truncated))
        finally:
            del frames, f   # never keep frames (and their locals) alive
        if len(self._natives) > 4 * max(1, len(out)) + 64:
            self._natives = {}
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
