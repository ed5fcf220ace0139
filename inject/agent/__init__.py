"""The in-process agent: loaded into the target by the bootstrap, runs on one daemon thread.

Stdlib only (GPU collectors feature-detect cupti-python / ctypes ROCm libraries). It never imports
the daemon, never raises into the target (every entry point catches BaseException), bounds its
memory (outbox <= 4 MiB, GPU record queue <= 100k, drops counted) and CPU (sampler rate adapts),
and detaches completely: collectors stopped, socket closed by the bootstrap, its modules removed
from ``sys.modules``, its thread gone.

Injected, the package is loaded as ``_stacklens_agent_<nonce>`` from a read-only directory without
writing bytecode; in tests it is the ordinary ``stacklens.inject.agent``.
"""

import collections
import math
import os
import select
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
# inject/agent/gpu/cupti.py says when); False leaves CUPTI initialised, its API hooks in place.
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


class _Outbox:
    """Frames waiting for the socket: a queue of byte strings and an offset into the first, so a
    partial send never moves the rest (raw CUPTI frames are 1 MiB; a bytearray's `del out[:n]`
    after each ~200 KiB send moved megabytes per second on the target's GIL)."""

    def __init__(self):
        self.chunks = collections.deque()
        self.size = 0            # bytes not yet sent
        self.off = 0             # into chunks[0]
        self.lock = threading.Lock()   # notes may be sent from a collector's thread

    def __len__(self):
        return self.size

    def __bytes__(self):
        return b"".join(self.chunks)[self.off:]

    def append(self, *parts):
        with self.lock:
            self.chunks.extend(parts)
            self.size += sum(len(p) for p in parts)

    def send_to(self, sock):
        """Write what the socket takes now; raises OSError (not BlockingIOError) if it broke."""
        chunks = self.chunks
        while chunks:
            head = chunks[0]
            try:
                n = sock.send(memoryview(head)[self.off:])
            except (BlockingIOError, InterruptedError):
                return
            self.off += n
            with self.lock:
                self.size -= n
            if self.off < len(head):
                return           # the socket is full
            chunks.popleft()
            self.off = 0


class Channel:
    """Non-blocking framed JSON over the connected socket; a bounded outbox, drops counted."""

    def __init__(self, sock, max_outbox=4 << 20):
        self.wire = _sub("wire")
        self.sock = sock
        sock.setblocking(False)
        self.out = _Outbox()
        self.inbuf = bytearray()
        self.max_outbox = max_outbox
        self.dropped_msgs = 0
        self.closed = False
        self.poller = select.poll()
        self.poller.register(sock.fileno(), select.POLLIN)
        self._want_out = False

    def send(self, msg):
        try:
            data = self.wire.encode(msg)
        except (TypeError, ValueError):
            self.dropped_msgs += 1
            return False
        if len(data) - 4 > self.wire.MAX_FRAME or len(self.out) + len(data) > self.max_outbox:
            self.dropped_msgs += 1
            return False
        self.out.append(data)
        return True

    def send_raw(self, header, body):
        """A raw frame (CUPTI buffer bytes); False when the outbox has no room for it now. The
        body is queued as it is (no copy of the buffer into a frame)."""
        prefix = self.wire.raw_prefix(header, len(body))
        n = len(prefix) + len(body)
        if n - 4 > self.wire.MAX_RAW_FRAME:
            self.dropped_msgs += 1
            return True               # never fits: consumed (and counted), not retried
        if len(self.out) + n > self.max_outbox:
            return False
        self.out.append(prefix, body)
        return True

    def pump(self, timeout_s):
        """Wait up to timeout_s; write what the socket takes, return complete incoming messages."""
        if self.closed:
            time.sleep(max(0.0, timeout_s))
            return []
        want = bool(self.out)
        if want != self._want_out:
            self.poller.modify(self.sock.fileno(), select.POLLIN | (select.POLLOUT if want else 0))
            self._want_out = want
        # poll() counts whole ms: round up. Rounded down, the last fraction of every wait of the
        # agent loop was a spin of poll(0) calls, each one giving the GIL away and taking it back
        # (24,000/s against a loop of small torch ops, 3,000/s against pure Python). A sample up to
        # 1 ms late is harmless: the schedule is absolute and jittered.
        events = self.poller.poll(math.ceil(timeout_s * 1000) if timeout_s > 0 else 0)
        msgs = []
        for _fd, ev in events:
            if ev & select.POLLOUT and self.out:
                try:
                    self.out.send_to(self.sock)
                except OSError:
                    self.closed = True
            if ev & (select.POLLIN | select.POLLHUP | select.POLLERR):
                try:
                    data = self.sock.recv(65536)
                except (BlockingIOError, InterruptedError):
                    data = None
                except OSError:
                    data = b""
                if data == b"":
                    self.closed = True
                elif data:
                    self.inbuf += data
                    msgs.extend(self._parse())
        return msgs

    def _parse(self):
        import json
        out = []
        while len(self.inbuf) >= 4:
            n = int.from_bytes(self.inbuf[:4], "big")
            if n > 65536:           # the daemon never sends this much: treat as a broken peer
                self.closed = True
                return out
            if len(self.inbuf) < 4 + n:
                break
            raw = bytes(self.inbuf[4:4 + n])
            del self.inbuf[:4 + n]
            try:
                msg = json.loads(raw)
            except ValueError:
                continue
            if isinstance(msg, dict) and isinstance(msg.get("t"), str):
                out.append(msg)
        return out

    def drain(self, timeout_s):
        """Blocking-ish flush of the outbox at detach, bounded by timeout_s."""
        end = time.monotonic() + timeout_s
        while self.out and not self.closed and time.monotonic() < end:
            self.pump(min(0.05, max(0.0, end - time.monotonic())))


class Agent:
    def __init__(self, sock, token, config=None):
        self.token = token
        self.cfg = dict(DEFAULTS)
        self.ch = Channel(sock)
        self.stop_requested = False
        self.detaching = False
        self.gpu = None
        self.jax = None                 # jaxmeta.JaxWatcher once the target has imported jax
        self.inductor = None            # inductor.InductorWatcher once torch.compile has compiled
        self.gpu_queue = collections.deque()
        self.gpu_dropped = 0
        self.raw_queue = collections.deque()    # ("json", msg) | ("raw", (header, body)), in order
        self.raw_in = 0                         # bytes queued (a collector's thread only)
        self.raw_out = 0                        # bytes sent on (the agent thread only)
        self.raw_dropped = 0                    # CUPTI buffers dropped (the daemon was too slow)
        self.max_gpu_queue = DEFAULTS["max_gpu_queue"]
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
        self.max_gpu_queue = max(1000, min(int(self.cfg["max_gpu_queue"]), 1_000_000))

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

    def gpu_sink(self, kind, rec):
        """Called from collector threads: never blocks, drops and counts when full."""
        if kind == "raw":
            n = len(rec[1])
            if self.raw_in - self.raw_out + n > self.cfg["max_raw_bytes"]:
                self.raw_dropped += 1
                return
            self.raw_in += n
            self.raw_queue.append(("raw", rec))
            return
        if kind == "rawref":           # (header, address, length): bounded by the collector
            self.raw_queue.append(("ref", rec))
            return
        if kind == "cupti_layout":
            self.raw_queue.append(("json", rec))
            return
        if len(self.gpu_queue) >= self.max_gpu_queue:
            self.gpu_dropped += 1
            return
        self.gpu_queue.append((kind, rec))

    def _handle(self, msgs):
        for m in msgs:
            t = m.get("t")
            if t == "stop":
                self.stop_requested = True
            elif t == "config":
                self._apply_config(m)
            elif t == "free":
                self._release(m.get("a"))
            elif t == "flush":
                fid = m.get("id")
                if type(fid) is int and len(self.flush_asked) < 64:
                    self.flush_asked.append(fid)

    def _gpu_call(self, name, *args, default=None):
        """A collector call that not every collector has (buffers left in place are CUPTI's);
        never raises into the agent loop."""
        fn = getattr(self.gpu, name, None)
        if fn is None:
            return default
        try:
            return fn(*args)
        except BaseException as e:
            self.note("warning", f"GPU collector {name} failed: {type(e).__name__}: {e}")
            return default

    def _release(self, addrs):
        """The daemon has read these buffers in place: the collector may reuse them."""
        if type(addrs) is list:
            self._gpu_call("release", [a for a in addrs if type(a) is int])

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
                self._start_gpu()
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

    def _start_gpu(self):
        starting = None
        try:
            gpu_mod = _sub("gpu")
            self.gpu = gpu_mod.select_collector(_sub, self.note)
            if self.gpu is not None and hasattr(self.gpu, "api_records"):
                self.gpu.api_records = bool(self.cfg["gpu_api_records"])
            if self.gpu is not None and hasattr(self.gpu, "raw"):
                self.gpu.raw = bool(self.cfg["gpu_raw"])
            if self.gpu is not None and hasattr(self.gpu, "periodic_flush"):
                self.gpu.periodic_flush = bool(self.cfg["gpu_flush"])
            if self.gpu is not None and hasattr(self.gpu, "finalize"):
                self.gpu.finalize = bool(self.cfg["gpu_finalize"])
            if self.gpu is not None and hasattr(self.gpu, "ref"):   # buffers read in place
                self.gpu.ref = bool(self.cfg["gpu_ref"])
                self.gpu.max_shipped = max(1, int(self.cfg["max_raw_bytes"]) >> 20)
            if self.gpu is not None:
                starting = self.gpu
                if not starting.start(self.gpu_sink):
                    self.gpu = None
        except BaseException as e:  # a collector must never take the agent (or target) down
            self.gpu = None
            self._note_error("GPU collector unavailable", e, level="warning")
            if starting is not None:    # start() failed part-way: what it enabled is disabled
                try:
                    starting.stop()
                except BaseException as e2:
                    self._note_error("GPU collector stop failed", e2, level="warning")

    def _flush(self, batch):
        if batch.samples:
            if not self.ch.send(batch.message()):
                self.samples_dropped += len(batch.samples)
            batch.clear()
        if self.gpu is not None:
            try:
                self.gpu.poll()
            except BaseException as e:
                self.note("warning", f"GPU collector poll failed: {e}")
        self._send_gpu_records()
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
            self._gpu_call("flush_now")
            self._flush(batch)
        else:
            self._send_gpu_records()
        if self.gpu_queue or self.raw_queue:
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

    @property
    def raw_bytes(self):
        """Bytes of CUPTI buffers queued and not yet in the outbox."""
        return self.raw_in - self.raw_out

    def _send_gpu_records(self):
        rq, ch = self.raw_queue, self.ch
        while rq:
            kind, item = rq[0]
            if kind == "json":
                if not ch.send(item) and ch.out:
                    break                          # outbox full: retried (the layout must arrive)
            elif kind == "ref":                    # a buffer left in place: address and length
                head, addr, n = item
                if not ch.send({"t": "cupti_ref", "h": head, "a": addr, "n": n}):
                    if ch.out:
                        break                      # outbox full: retried (the buffer waits)
                    self.raw_dropped += 1          # never sendable: the buffer is reused
                    self._release([addr])
            elif ch.send_raw(*item):
                self.raw_out += len(item[1])
            else:
                break                          # outbox full: the rest waits for the socket
            rq.popleft()
        q = self.gpu_queue
        groups = {}
        n = 0
        while q and n < 50000:   # per flush (every 200 ms): up to 250k records/s
            kind, rec = q.popleft()
            groups.setdefault(kind, []).append(rec)
            n += 1
        for kind, recs in groups.items():
            for i in range(0, len(recs), 2000):
                chunk = recs[i:i + 2000]
                msg = {"t": kind, "r": chunk}
                if kind == "kernel":  # kernel names (long C++ names) once per message, rows by index
                    ids = {}
                    for r in chunk:
                        r[0] = ids.setdefault(r[0], len(ids))
                    msg["n"] = list(ids)
                if not self.ch.send(msg):
                    self.gpu_dropped += len(chunk)

    def _send_stats(self, sampler):
        st = {"t": "stats", "samples": sampler.samples, "sample_hz": round(sampler.hz, 2),
              "sample_cost_us": round(sampler.cost_ewma * 1e6, 1),
              "dropped": {"samples": self.samples_dropped, "gpu": self.gpu_dropped,
                          "gpu_buffers": self.raw_dropped,
                          "messages": self.ch.dropped_msgs}}
        if self.jax is not None:
            st["dropped"]["jax"] = self.jax.dropped
        if self.inductor is not None:
            st["dropped"]["inductor"] = self.inductor.dropped
        if self.gpu is not None:
            try:
                st["gpu"] = self.gpu.stats()
            except BaseException:
                pass
        self.ch.send(st)

    def _detach(self, batch, sampler):
        """Never raises: the collectors are stopped first, each on its own, so CUPTI activity and
        the JAX listener are off in the target whatever fails after; then the last records, the
        stats and "bye" are sent on."""
        self.detaching = True
        for what, c in (("JAX support", self.jax), ("GPU collector", self.gpu)):
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
            while (self.gpu_queue or self.raw_queue or self._gpu_call("shipped", default=0)) \
                    and time.monotonic() < end \
                    and not self.ch.closed:
                self._send_gpu_records()
                self._handle(self.ch.pump(0.01))
            self._gpu_call("drop_shipped")
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
