"""The in-process agent: loaded into the target by the bootstrap, runs on one daemon thread.

Stdlib only (GPU collectors feature-detect cupti-python / ctypes ROCm libraries). It never imports
the daemon, never raises into the target (every entry point catches BaseException), bounds its
memory (outbox <= 4 MiB, GPU record queue <= 100k, drops counted) and CPU (sampler rate adapts),
and detaches completely: collectors stopped, socket closed by the bootstrap, its modules removed
from ``sys.modules``, its thread gone.

Injected, the package is loaded as ``_stacklens_agent_<nonce>`` from a read-only directory without
writing bytecode; in tests it is the ordinary ``stacklens.inject.agent``.
"""

import math
import os
import sys
import threading
import time

DEFAULTS = {"sample_hz": 100.0, "max_depth": 128, "max_overhead": 0.02, "flush_ms": 200,
            "gpu": True, "max_outbox": 4 << 20, "max_gpu_queue": 100_000, "jax": True,
            "gpu_api_records": False, "gpu_raw": True, "gpu_ref": True, "max_raw_bytes": 64 << 20,
            "gpu_finalize": True,
            "gpu_flush": True, "switch_s": 0.0, "inductor": True,
            "module_paths": sys.version_info >= (3, 13)}
# gpu_flush: the collector asks CUPTI once a second for completed buffers. CUPTI's own periodic
# flush is not the same: it may return only full buffers, so with False a partly filled buffer
# waits until it fills or until detach. switch_s: the GIL switch interval while the agent runs
# (the bootstrap's 0.5 ms otherwise), restored at detach; 0 leaves it alone, and only
# SWITCH_RANGE_S is accepted (a value outside it is ignored with a note). Both exist to measure
# what each costs a job (benchmarks/gpu/bench_overhead.py variants).
# gpu_finalize: the GPU collector tears CUPTI down at detach where that is safe (cuptiFinalize;
# inject/agent/gpu/cupti_teardown.py says when); False leaves CUPTI initialised, its API hooks in place.
# module_paths: the sampler names module forwards by attribute path (reads `self` of the frame);
# on by default from Python 3.13 only, where reading it copies nothing (sampler.py says why).
SWITCH_RANGE_S = (1e-4, 0.05)   # below: forced switching nearly every bytecode; above: the agent
                                # thread may again starve for the GIL (inject/bootstrap.py says why)


def _sub(name):
    """Import a module of the agent ("sampler", "gpu", "gpu.cupti"); in injected mode compile it
    from source (no bytecode written). A folder is a package (its ``__init__.py``): the GPU
    collectors live in ``gpu/``, one module per vendor."""
    full = __name__ + "." + name
    mod = sys.modules.get(full)
    if mod is not None:
        return mod
    if not __name__.startswith("_stacklens_agent"):
        import importlib
        return importlib.import_module(full)
    import types
    base = os.path.join(os.path.dirname(__file__), *name.split("."))
    package = os.path.isdir(base)
    path = os.path.join(base, "__init__.py") if package else base + ".py"
    if "." in name:
        _sub(name.rpartition(".")[0])        # the parent package first, as import does
    with open(path, "rb") as fh:
        code = compile(fh.read(), path, "exec")
    mod = types.ModuleType(full)
    mod.__file__ = path
    mod.__package__ = full if package else full.rpartition(".")[0]
    if package:
        mod.__path__ = [base]
    sys.modules[full] = mod
    exec(code, mod.__dict__)
    return mod


class Agent:
    def __init__(self, sock, token, config=None):
        self.token = token
        self.cfg = dict(DEFAULTS)
        self.ch = _sub("channel").Channel(sock)
        self.stop_requested = False
        self.detaching = False
        self.gpu = _sub("relay").GpuRelay(self.ch, self.cfg, self.note)   # the GPU collector's records
        self.jax = None                 # jaxmeta.JaxWatcher once the target has imported jax
        self.inductor = None            # inductor.InductorWatcher once torch.compile has compiled
        self.samples_dropped = 0
        self.flush_asked = []           # ids of the daemon's edge flushes not yet answered
        self.flush_at_ns = None         # CLOCK_MONOTONIC when the GPU collector was last flushed for them
        if config:
            self._apply_config(config)

    # -- helpers -----------------------------------------------------------------------
    def _apply_config(self, msg):
        """Never raises: a value that is not finite or does not convert keeps the one before."""
        for k, default in DEFAULTS.items():
            v = msg.get(k)
            if isinstance(v, bool) and isinstance(default, bool):
                self.cfg[k] = v
            elif isinstance(v, (int, float)) and not isinstance(v, bool) and not isinstance(default, bool):
                try:
                    v = type(default)(v)            # int(inf) and float(10**400) raise; int(nan) too
                    if isinstance(v, float) and not math.isfinite(v):
                        continue
                except (OverflowError, ValueError, TypeError):
                    continue
                self.cfg[k] = v
        self.ch.max_outbox = max(1 << 16, min(int(self.cfg["max_outbox"]), 64 << 20))
        self.gpu.max_queue = max(1000, min(int(self.cfg["max_gpu_queue"]), 1_000_000))

    def note(self, level, message):
        self.ch.send({"t": "note", "level": level, "msg": str(message)[:2000], "t_ns": time.monotonic_ns()})

    def _note_error(self, what, e, level="error"):
        """A note "what: Type: message" that never raises (str(e) of a foreign exception may)."""
        try:
            try:
                desc = f"{type(e).__name__}: {e}"
            except BaseException:
                desc = f"{type(e).__name__}: <unprintable>"
            self.note(level, f"{what}: {desc}")
        except BaseException:
            pass

    def _handle(self, msgs):
        for m in msgs:
            t = m.get("t")
            if t == "stop":
                self.stop_requested = True
            elif t == "config":
                self._apply_config(m)
            elif t == "free":
                self.gpu.release(m.get("a"))
            elif t == "flush":
                fid = m.get("id")
                if type(fid) is int and len(self.flush_asked) < 64:
                    self.flush_asked.append(fid)

    # -- main loop ---------------------------------------------------------------------
    def run(self):
        ch = self.ch
        ch.send({"t": "hello", "v": 1, "pid": os.getpid(), "tid": threading.get_native_id(),
                 "python": list(sys.version_info[:3]), "token": self.token,
                 "executable": sys.executable[:4096]})
        end = time.monotonic() + 2.0
        while time.monotonic() < end and not ch.closed:
            msgs = ch.pump(0.05)
            self._handle(msgs)
            if any(m.get("t") == "config" for m in msgs) or self.stop_requested:
                break
        switch_prev = self._set_switch_interval()
        try:
            self._loop()
        finally:   # also when the loop raised: the bootstrap restores only its own 0.5 ms
            if switch_prev is not None and sys.getswitchinterval() == self._switch_set:
                sys.setswitchinterval(switch_prev)   # unless the program changed it since

    def _loop(self):
        sampler_mod = _sub("sampler")
        sampler = sampler_mod.Sampler(self.cfg["sample_hz"], self.cfg["max_depth"],
                                      self.cfg["max_overhead"], skip_idents={threading.get_ident()},
                                      module_paths=self.cfg["module_paths"])
        if not sampler.module_paths:
            self.note("info", "module paths off: naming a module's forward reads its frame's self, "
                              "which before Python 3.13 copies and holds the frame's locals; frames "
                              "keep their qualname (agent option module_paths=true turns it on)")
        batch = _SampleBatch()
        # from here on collectors may run in the target: whatever fails, _detach stops them (and it
        # never raises), and the daemon is told why the agent ended
        try:
            if self.cfg["gpu"] and not self.stop_requested:
                self.gpu.start(_sub, self._note_error)
            self._sample_until_stopped(sampler, batch)
        except BaseException as e:
            self._note_error("agent loop failed", e)
        finally:
            self._detach(batch, sampler)

    def _sample_until_stopped(self, sampler, batch):
        ch = self.ch
        flush_s = max(0.02, self.cfg["flush_ms"] / 1000.0)
        now = time.monotonic()
        next_sample, next_flush, next_stats = now, now + flush_s, now + 1.0
        last_hz = sampler.hz
        while not self.stop_requested and not ch.closed:
            now = time.monotonic()
            if now >= next_sample:
                for s in sampler.sample():
                    if not batch.add(s):
                        self.samples_dropped += 1
                next_sample += sampler.next_interval()
                if next_sample < now:          # we fell behind: do not burst to catch up
                    next_sample = now + sampler.next_interval()
                if sampler.hz != last_hz:
                    self.note("info", f"sampler rate {sampler.hz:.1f} Hz "
                                      f"(sample cost {sampler.cost_ewma * 1e6:.0f} us)")
                    last_hz = sampler.hz
            if now >= next_flush:
                self._flush(batch)
                next_flush = now + flush_s
            if now >= next_stats:
                self._send_stats(sampler)
                next_stats = now + 1.0
            if self.flush_asked:
                self._edge_flush(batch)
            wait = min(next_sample, next_flush) - time.monotonic()
            if self.flush_asked:
                wait = min(wait, 0.005)        # its records are still on their way out
            self._handle(ch.pump(max(0.0, wait)))

    def _set_switch_interval(self):
        """switch_s in SWITCH_RANGE_S: that GIL switch interval while attached; returns the one to
        restore (None: nothing was set)."""
        want = self.cfg["switch_s"]
        if want == 0.0:
            return None
        lo, hi = SWITCH_RANGE_S
        if not lo <= want <= hi:
            self.note("warning", f"switch_s {want!r} ignored: outside [{lo}, {hi}] s")
            return None
        prev = sys.getswitchinterval()
        sys.setswitchinterval(want)
        self._switch_set = sys.getswitchinterval()   # as CPython rounded it
        return prev

    def _flush(self, batch):
        if batch.samples:
            if not self.ch.send(batch.message()):
                self.samples_dropped += len(batch.samples)
            batch.clear()
        if self.gpu.collector is not None:
            try:
                self.gpu.collector.poll()
            except BaseException as e:
                self.note("warning", f"GPU collector poll failed: {e}")
        self.gpu.send()
        self._poll_jax()
        self._poll_inductor()

    def _edge_flush(self, batch):
        """The daemon's window edge: every GPU record of activity completed by now is handed over
        (CUPTI's forced flush: records of kernels still running come back incomplete and are
        counted lost by the daemon), with the samples; then {"t": "flushed", "id", "t_ns"} once
        they are all in the outbox, after them on the ordered socket. One flush answers every
        request that came before it."""
        if self.flush_at_ns is None:
            self.flush_at_ns = time.monotonic_ns()
            self.gpu.call("flush_now")
            self._flush(batch)
        else:
            self.gpu.send()
        if self.gpu.pending:
            return                             # the outbox is full: answered once they are out
        if self.ch.send({"t": "flushed", "id": self.flush_asked[-1], "t_ns": self.flush_at_ns}):
            self.flush_asked = []
            self.flush_at_ns = None

    def _poll_inductor(self):
        # torch._inductor.codecache is imported when torch.compile first compiles a graph
        if not self.cfg["inductor"] or "torch._inductor.codecache" not in sys.modules:
            return
        try:
            if self.inductor is None:
                self.inductor = _sub("inductor").InductorWatcher(self.ch.send, self.note)
            self.inductor.poll()
        except BaseException as e:
            self.cfg["inductor"] = False
            self.note("warning", f"torch.compile support stopped: {type(e).__name__}: {e}")

    def _poll_jax(self):
        if not self.cfg["jax"] or "jax" not in sys.modules:
            return
        try:
            if self.jax is None:
                if self.detaching:     # a watcher started now would never be stopped
                    return
                self.jax = _sub("jaxmeta").JaxWatcher(self.ch.send, self.note)
            self.jax.poll()
        except BaseException as e:
            self.cfg["jax"] = False
            self.note("warning", f"JAX support stopped: {type(e).__name__}: {e}")

    def _send_stats(self, sampler):
        st = {"t": "stats", "samples": sampler.samples, "sample_hz": round(sampler.hz, 2),
              "sample_cost_us": round(sampler.cost_ewma * 1e6, 1),
              "dropped": {"samples": self.samples_dropped, "gpu": self.gpu.dropped,
                          "gpu_buffers": self.gpu.raw_dropped,
                          "messages": self.ch.dropped_msgs}}
        if self.jax is not None:
            st["dropped"]["jax"] = self.jax.dropped
        if self.inductor is not None:
            st["dropped"]["inductor"] = self.inductor.dropped
        if self.gpu.collector is not None:
            try:
                st["gpu"] = self.gpu.collector.stats()
            except BaseException:
                pass
        self.ch.send(st)

    def _detach(self, batch, sampler):
        """Never raises: the collectors are stopped first, each on its own, so CUPTI activity and
        the JAX listener are off in the target whatever fails after; then the last records, the
        stats and "bye" are sent on."""
        self.detaching = True
        for what, c in (("JAX support", self.jax), ("GPU collector", self.gpu.collector)):
            if c is not None:
                try:
                    c.stop()
                except BaseException as e:
                    self._note_error(f"{what} stop failed", e, level="warning")
        bye = False
        try:
            self._flush(batch)
            end = time.monotonic() + 2.0
            # the final forced flush can exceed one batch; buffers left in place wait for the
            # daemon's "free" (it reads them from our memory); those it never frees are parked
            while (self.gpu.pending or self.gpu.call("shipped", default=0)) \
                    and time.monotonic() < end \
                    and not self.ch.closed:
                self.gpu.send()
                self._handle(self.ch.pump(0.01))
            self.gpu.call("drop_shipped")
            self._send_stats(sampler)
            bye = self.ch.send({"t": "bye"})
            self.ch.drain(2.0)
        except BaseException as e:
            self._note_error("agent detach failed", e)
            try:
                if not bye:
                    self.ch.send({"t": "bye"})
                self.ch.drain(1.0)
            except BaseException:
                pass


class _SampleBatch:
    """Samples between two flushes; identical stacks are sent once per message."""

    MAX_SAMPLES = 5000

    def __init__(self):
        self.clear()

    def clear(self):
        self.stacks = {}
        self.samples = []
        self.last = {}           # tid -> (stack, index): a thread's stack often repeats

    def add(self, s):
        if len(self.samples) >= self.MAX_SAMPLES:
            return False
        tid, t_ns, stack, truncated = s
        last = self.last.get(tid)
        if last is not None and last[0] == stack:
            idx = last[1]        # equal frames are one shared tuple: == is a pointer walk, hash is not
        else:
            idx = self.stacks.get(stack)
            if idx is None:
                idx = self.stacks[stack] = len(self.stacks)
            self.last[tid] = (stack, idx)
        self.samples.append([tid, t_ns, idx, 1 if truncated else 0])
        return True

    def message(self):
        return {"t": "samples", "stacks": list(self.stacks), "s": self.samples}   # tuples: JSON arrays


def main(sock, token):
    """Entry point called by the bootstrap on the agent thread. Never raises."""
    try:
        return _main(sock, token)
    finally:
        # from here on a new bootstrap may start the next agent while this thread finishes
        try:
            threading.current_thread().name = "stacklens-agent-exiting"
        except BaseException:
            pass


def _main(sock, token):
    agent = None
    try:
        agent = Agent(sock, token)
        agent.run()
    except BaseException as e:
        try:                  # tell the daemon why we stopped, then leave quietly
            agent.note("error", f"agent stopped: {type(e).__name__}: {e}")
            agent.ch.send({"t": "bye"})
            agent.ch.drain(1.0)
        except BaseException:
            pass
