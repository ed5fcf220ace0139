"""JAX support of the agent: HLO source maps of compiled executables and compile times.

Stdlib only. Never imports JAX: everything it touches is taken from ``sys.modules`` and only once
the target has finished importing ``jax`` itself (a half-initialised module is left alone).

What it sends (wire kinds, validated by ``stacklens.inject.channel.messages``):
- ``hlo``: per compiled XLA module, every instruction that can launch a kernel (fusions,
  custom calls, ...) in schedule order, with the original JAX operators it was fused from:
  ``(op_name, source_file, source_line, function)`` from the HLO metadata (both the
  ``source_file=/source_line=`` form and the ``stack_frame_id=`` + StackFrames table form).
  The daemon matches GPU kernel names (XLA names a fusion's kernel after the instruction) to it.
- ``compile``: the ``/jax/core/compile/*`` duration events of ``jax.monitoring`` (trace, lowering,
  backend compile) with the Python stack of the thread that compiled, trimmed to the user frames
  outside JAX (the call site that triggered the compilation). Nested events (an inner jit traced
  inside an outer trace) are skipped so time is never counted twice.
- a Note when the process runs JAX on CPU only: kernel attribution needs a GPU backend.

Executables are found two ways: the backend-compile listener takes the ``xla_executable`` local
of the compiling frame (``pxla._cached_compilation``) as the event fires, and one
``gc.get_referrers(MeshExecutable)`` at start finds those compiled before the attach (the class's
instances only, ``heapscan.py``: a list of every object would hold each of the target's arrays
while this thread walked it, and one the target dropped meanwhile would die later, on this thread;
skipped where the heap is too large to walk without stopping the job).
HLO text is produced and parsed on the agent thread, never on the target's compiling thread.
"""

import collections
import json
import os
import sys
import threading
import time

# modules of the agent ("hlo", "heapscan"), through the agent package (loaded before it)
_sub = sys.modules[__name__.rpartition(".")[0]]._sub
_hlo = _sub("hlo")
parse_hlo_text = _hlo.parse_hlo_text     # HLO text -> the module's kernel-launching instructions

COMPILE_PREFIX = "/jax/core/compile/"
BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
GPU_PLATFORMS = ("cuda", "rocm", "gpu", "METAL")
MAX_OPS = _hlo.MAX_OPS          # JAX operators kept per instruction
MAX_SITE = 64
MAX_QUEUE = 1000
MAX_SENT_KEYS = 20000
MSG_BUDGET = 400_000            # bytes of entries/rows per message (a part of a module; compile rows)
FRAME_BUDGET = 1_000_000        # bytes of one encoded message, hard (wire.MAX_FRAME is 1 MiB): a message
                                # the channel cannot take must never wait in `pending` forever
MAX_ROWS = 10_000               # entries/rows per message (the daemon takes <= 20000)
MAX_HLO_CHARS = 64 << 20        # larger HLO texts are not parsed (a note says so)
# string limits of the daemon's schema (stacklens.inject.channel.messages.HLO_LIMITS; site frames:
# MAX_STR 8192, cut shorter here): longer strings are cut before sending, so real data is never
# rejected
LIMITS = {"id": 128, "module": 512, "platform": 32, "instr": 1024, "opcode": 64, "op_name": 2048,
          "file": 8192, "func": 1024, "event": 128, "fun_name": 256, "site_str": 1024}
MAX_LINE = 1 << 31


def jax_ready():
    """The jax package, if the target imported it completely; else None."""
    jax = sys.modules.get("jax")
    if jax is None:
        return None
    spec = getattr(jax, "__spec__", None)
    if spec is not None and getattr(spec, "_initializing", False):
        return None
    if "jax._src.monitoring" not in sys.modules or not hasattr(jax, "jit"):
        return None
    return jax


# ---- call sites and message sizes ---------------------------------------------------------------

def _jax_dirs():
    dirs = []
    for name in ("jax", "jaxlib"):
        mod = sys.modules.get(name)
        f = getattr(mod, "__file__", None)
        if f:
            dirs.append(os.path.dirname(f) + os.sep)
    return tuple(dirs)


def call_site(frame, jax_dirs, max_depth=MAX_SITE):
    """Frames outermost first, from the outermost one down to (excluding) the first frame in JAX."""
    stack = []
    f = frame
    while f is not None and len(stack) < 512:
        stack.append(f)
        f = f.f_back
    stack.reverse()
    out = []
    for f in stack:
        co = f.f_code
        if co.co_filename.startswith(jax_dirs):
            break
        out.append((co.co_filename, getattr(co, "co_qualname", co.co_name), f.f_lineno or 0))
    return out[-max_depth:]


def _nested(frame, emitter):
    """True if `emitter`'s code object is also running further up: an event inside another."""
    f = frame
    while f is not None:
        if f.f_code is emitter:
            return True
        f = f.f_back
    return False


# ---- fitting messages to the daemon's schema ------------------------------------------------------

def _line(v):
    return v if type(v) is int and 0 <= v <= MAX_LINE else 0


def fit_site(site):
    n = LIMITS["site_str"]
    return [[str(f)[:n], str(fn)[:n], _line(ln)] for f, fn, ln in list(site)[-MAX_SITE:]]


def fit_entry(e):
    """[instr, opcode, ops] cut to the schema's limits."""
    name, opcode, ops = e
    return [str(name)[:LIMITS["instr"]], str(opcode)[:LIMITS["opcode"]],
            [[str(o[0])[:LIMITS["op_name"]], str(o[1])[:LIMITS["file"]], _line(o[2]), str(o[3])[:LIMITS["func"]]]
             for o in list(ops)[:MAX_OPS]]]


def encoded_size(obj):
    """Bytes of obj as the wire encodes it (compact JSON, UTF-8)."""
    return len(json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode("utf-8", "replace"))


def chunk_by_size(items, base, budget=MSG_BUDGET, max_rows=MAX_ROWS):
    """Split items into lists whose message (base bytes of envelope + items) stays within budget
    (an item larger than that goes alone); items that cannot fit a frame at all are dropped.
    Returns (chunks, dropped)."""
    chunks, cur, size, dropped = [], [], base, 0
    for it in items:
        n = encoded_size(it) + 1
        if base + n > FRAME_BUDGET:
            dropped += 1
            continue
        if cur and (size + n > budget or len(cur) >= max_rows):
            chunks.append(cur)
            cur, size = [], base
        cur.append(it)
        size += n
    if cur or not chunks:
        chunks.append(cur)
    return chunks, dropped


# ---- the watcher --------------------------------------------------------------------------------

class JaxWatcher:
    """Started by the agent when the target has imported jax; runs on the agent thread except for
    the monitoring listener, which only appends to a bounded deque."""

    def __init__(self, send, note, scan_existing=True):
        self.send = send                  # send(msg) -> bool (False: outbox full)
        self.note = note
        self.scan_existing = scan_existing
        self.started = False
        self.stopped = False
        self.queue = collections.deque()  # ("compile", row) | ("exe", executable, site)
        self.pending = collections.deque()  # messages the outbox refused, retried next poll
        self.sent_keys = set()
        self.dropped = 0
        self.compile_events = 0
        self.nested_skipped = 0
        self.modules_sent = 0
        self.platforms_noted = False
        self._listener = None
        self._monitoring = None
        self._jax_dirs = ()
        self._next_id = 0

    # -- lifecycle --------------------------------------------------------------------------
    def poll(self):
        if self.stopped:
            return
        if not self.started:
            if jax_ready() is None:
                return
            self._start()
        self._check_platforms()
        self._drain()

    def _start(self):
        self.started = True
        self._jax_dirs = _jax_dirs()
        mon = sys.modules.get("jax._src.monitoring")
        q = self.queue
        jax_dirs = self._jax_dirs
        getframe = sys._getframe
        counters = self

        def listener(event, duration, **kw):
            # runs on the target's thread that compiles: append and return, never raise
            try:
                if not event.startswith(COMPILE_PREFIX):
                    return
                if len(q) >= MAX_QUEUE:
                    counters.dropped += 1
                    return
                f = getframe(1)                    # record_event_duration_secs
                ex_frame = f.f_back                # LogElapsedTimeContextManager.__exit__
                emitter_frame = ex_frame.f_back if ex_frame is not None else None
                if emitter_frame is not None and _nested(emitter_frame.f_back, emitter_frame.f_code):
                    counters.nested_skipped += 1
                    return
                site = call_site(f, jax_dirs)
                now = time.monotonic_ns()
                dur = max(0, int(float(duration) * 1e9))
                fun = str(kw.get("fun_name", ""))[:256]
                q.append(("compile", [event[:128], fun, now, dur, threading.get_native_id(), site]))
                if event == BACKEND_COMPILE_EVENT:
                    g = emitter_frame
                    for _ in range(4):
                        if g is None:
                            break
                        ex = g.f_locals.get("xla_executable") if "xla_executable" in g.f_code.co_varnames else None
                        if ex is not None:
                            q.append(("exe", ex, site))
                            break
                        g = g.f_back
            except BaseException:
                counters.dropped += 1

        if mon is not None:
            try:
                mon.register_event_duration_secs_listener(listener)
                self._listener = listener
                self._monitoring = mon
            except BaseException as e:
                self.note("warning", f"jax: could not register a jax.monitoring listener ({e}); "
                                     "compile times unavailable")
        if self.scan_existing:
            self._scan_existing()

    def stop(self):
        if self.stopped:
            return
        self.stopped = True
        mon, lis = self._monitoring, self._listener
        self._listener = self._monitoring = None
        if mon is not None and lis is not None:
            try:
                unreg = getattr(mon, "unregister_event_duration_listener", None)
                if unreg is not None:
                    unreg(lis)
                else:
                    mon._event_duration_secs_listeners.remove(lis)
            except BaseException:
                try:
                    mon._event_duration_secs_listeners.remove(lis)
                except BaseException:
                    pass
        try:
            self._drain()
        except BaseException:
            pass
        self.queue.clear()

    def stats(self):
        return {"jax_modules": self.modules_sent, "jax_compile_events": self.compile_events,
                "jax_dropped": self.dropped, "jax_nested_skipped": self.nested_skipped}

    # -- work on the agent thread -----------------------------------------------------------
    def _scan_existing(self):
        pxla = sys.modules.get("jax._src.interpreters.pxla")
        cls = getattr(pxla, "MeshExecutable", None)
        if cls is None:
            return
        found = 0
        try:
            heapscan = _sub("heapscan")
            live = heapscan.instances((cls,))
            if live is None:
                self.note("info", "jax: executables compiled before the attach not looked for: the heap "
                          f"is over {heapscan.MAX_SCAN_BLOCKS} blocks (a walk would stop the job's threads "
                          "for about a second); each is read when it compiles again")
                return
            for o in live:
                ex = getattr(o, "xla_executable", None)
                if ex is not None and len(self.queue) < MAX_QUEUE:
                    self.queue.append(("exe", ex, []))
                    found += 1
        except BaseException as e:
            self.note("warning", f"jax: scan for executables compiled before attach failed: {e}")

    def _check_platforms(self):
        if self.platforms_noted:
            return
        xb = sys.modules.get("jax._src.xla_bridge")
        backends = getattr(xb, "_backends", None)
        if not backends:
            return
        plats = sorted(str(p) for p in list(backends))
        self.platforms_noted = True
        if not any(p in GPU_PLATFORMS for p in plats):
            self.note("info", "JAX runs on CPU only (backends: " + ", ".join(plats) + "): kernel "
                      "attribution through XLA fusion metadata needs a GPU backend (CUDA or ROCm). "
                      "Reported here: Python samples, compile times per call site, HLO source maps.")

    def _drain(self):
        while self.pending:
            if not self.send(self.pending[0]):
                return
            self.pending.popleft()
        rows = []
        q = self.queue
        budget = 200                      # executables parsed per poll: bounded work per flush
        while q:
            item = q.popleft()
            if item[0] == "compile":
                rows.append(item[1])
                self.compile_events += 1
            elif budget > 0:
                budget -= 1
                try:
                    self._executable(item[1], item[2])
                except BaseException as e:
                    self.note("warning", f"jax: HLO of an executable unreadable: {type(e).__name__}: {e}")
            else:
                q.appendleft(item)
                break
        if rows:
            rows = [[str(ev)[:LIMITS["event"]], str(fun)[:LIMITS["fun_name"]], max(0, int(t)), max(0, int(d)),
                     tid if type(tid) is int and 0 <= tid <= MAX_LINE else 0, fit_site(site)]
                    for ev, fun, t, d, tid, site in rows]
            chunks, dropped = chunk_by_size(rows, encoded_size({"t": "compile", "r": []}))
            self.dropped += dropped
            for c in chunks:
                if c:
                    self._send({"t": "compile", "r": c})

    def _send(self, msg):
        if encoded_size(msg) > FRAME_BUDGET:   # never fits a frame: drop rather than block `pending`
            self.dropped += 1
            return
        if self.pending or not self.send(msg):
            if len(self.pending) < 256:
                self.pending.append(msg)
            else:
                self.dropped += 1

    def _executable(self, ex, site):
        fp = None
        try:
            fp = ex.fingerprint
        except BaseException:
            pass
        if isinstance(fp, bytes):
            fp = fp.decode("ascii", "replace")
        key = fp if fp else "id-%x" % id(ex)
        if key in self.sent_keys:
            return
        if len(self.sent_keys) >= MAX_SENT_KEYS:
            self.sent_keys.clear()
        self.sent_keys.add(key)
        platform = ""
        try:
            platform = str(ex.client.platform)
        except BaseException:
            pass
        texts = []
        try:
            texts = [m.to_string() for m in ex.hlo_modules()]
        except BaseException:
            try:
                texts = [ex.get_hlo_text()]
            except BaseException:
                texts = []
        for i, text in enumerate(texts):
            if len(text) > MAX_HLO_CHARS:
                self.note("warning", f"jax: HLO module of {len(text)} characters not parsed")
                continue
            module, entries = parse_hlo_text(text)
            mid = (key if len(texts) == 1 else f"{key}/{i}")[:128]
            self._send_module(mid, module, platform, site, entries)

    def _send_module(self, mid, module, platform, site, entries):
        head = {"t": "hlo", "id": str(mid)[:LIMITS["id"]], "module": str(module)[:LIMITS["module"]],
                "platform": str(platform)[:LIMITS["platform"]], "part": 0, "parts": 1, "site": fit_site(site),
                "k": []}
        parts, dropped = chunk_by_size([fit_entry(e) for e in entries], encoded_size(head) + 8)
        self.dropped += dropped
        for i, p in enumerate(parts):
            self._send({**head, "part": i, "parts": len(parts), "k": p})
        self.modules_sent += 1
