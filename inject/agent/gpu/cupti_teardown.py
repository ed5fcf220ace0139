"""CUPTI torn down at detach: cuptiFinalize in an API-exit callback of our own (part of ``CuptiCollector``).

Runs in the target, on the agent thread, once per detach, from the collector's ``stop``
(``cupti.py``); where torch's CUDA graphs are loaded, after one walk of the referrers of their
class (``graph_users``).

Detach (``stop``): activities disabled and a forced flush, then the teardown (``_teardown``).
Disabled and flushed, CUPTI still leaves its API hooks in the process (measured on the H200: the
launch loop 1.13-1.15x and a batch-1 decode job 1.06-1.14x slower after detach; in a ctypes probe
after cuptiFinalize 0.90-1.00x of its speed before). Only cuptiFinalize removes them, and it is
safe only inside an API-exit callback (NVIDIA's cupti_finalize sample; Kineto's teardown): we
subscribe for a moment, enable the exit callback of one runtime call the target practically
never makes (cudaRuntimeGetVersion: no device, no context, so no other thread of the target waits
in our Python callback for the GIL), make that call through the process's libcudart from the
agent thread, and in its exit callback unsubscribe and finalize. The next CUPTI call (our next attach, the user's
torch.profiler) initialises CUPTI again (measured: torch.profiler then records every kernel).
Skipped, with a note, and CUPTI left as it is: below CUDA 12.6 (CUPTI API version 24 and driver
12060; before it, finalize crashed CUDA graphs: pytorch#146604, #150957); where CUDA graphs may
replay (``graph_users``: it still kills them on CUDA 13.0); while a profiler of the
user's own is active; when cuptiSubscribe fails because someone holds the one subscriber (39,
MULTIPLE_SUBSCRIBERS: Kineto keeps its own once torch.profiler has run); with gpu_finalize off.
Costs one subscribe, one runtime call and the finalize, once per detach.
The teardown's ctypes callback (``_Finalizer``) is never freed: one per process and pair of
libraries, reused by later detaches, like the raw-buffer trampolines (``cupti_raw.py``).
"""

import os
import sys
import threading

# a module of the agent ("gpu", "wire"), through this package's parent (loaded before it)
_agent = sys.modules[__name__.rpartition(".")[0]].agent_module

FINALIZE_MIN_CUPTI = 24          # CUPTI API version of CUDA 12.6 (cupti_version.h)
FINALIZE_MIN_DRIVER = 12060      # cudaDriverGetVersion of CUDA 12.6
FINALIZE_WAIT_S = 2.0            # for a finalize another thread's exit callback has begun
RUNTIME_API = 2                  # CUPTI_CB_DOMAIN_RUNTIME_API
API_EXIT = 1                     # CUpti_CallbackData.callbackSite, its first field
TRIGGER_CBID = 2                 # CUPTI_RUNTIME_TRACE_CBID_cudaRuntimeGetVersion_v3020 (checked by name)
MULTIPLE_SUBSCRIBERS = 39        # CUPTI_ERROR_MULTIPLE_SUBSCRIBERS_NOT_SUPPORTED


class Teardown:
    """The collector's teardown, mixed into ``CuptiCollector`` (its ``__init__`` sets the state
    used here: ``finalize``, ``finalized``, ``_gpu``, ``_cupti_paths``, ``note``)."""

    def _teardown(self):
        """cuptiFinalize in the exit callback of our own runtime call (the module docstring says
        why and when); a note says what happened. Never raises: activities are already off."""
        if not self.finalize:
            self.note("info", "CUPTI left initialised at detach (gpu_finalize off): its API hooks stay")
            return
        try:
            skipped = self._finalize()
        except Exception as e:
            skipped = ("warning", f"{type(e).__name__}: {e}")
        if skipped is None:
            self.finalized += 1
            self.note("info", "cupti finalized: CUPTI's API hooks are out of the process")
        else:
            level, why = skipped
            self.note(level, f"CUPTI finalize skipped: {why}; activities are off, CUPTI's API hooks "
                             "stay (launches may run a few % slower until the process exits)")

    def _finalize(self):
        """None once finalized, else (note level, why not)."""
        gpu = self._gpu or _agent("gpu")
        who = gpu.user_profiler_active(maps=False)
        if who:
            return "info", f"{who} is active in the target"
        maps = gpu.mapped_libraries()
        cupti = self._cupti_paths or sorted(p for p in maps if "libcupti" in os.path.basename(p))
        cudart = sorted(p for p in maps if os.path.basename(p).startswith("libcudart"))
        if not cupti or not cudart:
            return "info", ("no libcudart mapped (a static CUDA runtime) to make the call it needs"
                            if cupti else "libcupti is not mapped")
        graphs = graph_users()
        if graphs:
            return "info", f"{graphs}: finalize under graph replays killed jobs"
        fin = _finalizer(cupti[0], cudart[0])
        cupti_v, driver_v = fin.versions()
        if cupti_v < FINALIZE_MIN_CUPTI or driver_v < FINALIZE_MIN_DRIVER:
            return "info", (f"CUDA < 12.6 (CUPTI API version {cupti_v}, driver {driver_v}), where "
                            "finalize crashed CUDA graphs")
        return fin.run(FINALIZE_WAIT_S)


def graph_users(modules=None):
    """Why CUDA graphs may run in this process (a reason), or None.

    cuptiFinalize while graphs replay is fatal: measured on the H200 (CUDA 13.0, driver 580), a
    jitted JAX step (XLA replays command buffers) and a ``torch.cuda.graph`` replay loop died with
    CUDA_ERROR_LAUNCH_FAILED at their next synchronisation after a detach that finalized, on 11 of
    12 and 6 of 6 cycles; with activities disabled and flushed but CUPTI left initialised, none did.
    So finalize is skipped where a graph may replay: JAX loaded (XLA's command buffers are on by
    default), or a ``torch.cuda.CUDAGraph`` alive (manual graphs, cudagraph trees of
    ``mode="reduce-overhead"``, CUDA-graph inference servers). The graphs are found with
    ``gc.get_referrers`` on their class: its instances only, never a list of the whole heap."""
    mods = sys.modules if modules is None else modules
    for name in ("jaxlib", "jax"):
        if name in mods:
            return f"{name} is loaded (XLA replays its steps as CUDA graphs)"
    graphs = mods.get("torch.cuda.graphs")
    cls = getattr(graphs, "CUDAGraph", None) if graphs is not None else None
    if isinstance(cls, type):
        import gc
        classes, todo = set(), [cls]
        while todo and len(classes) < 64:          # a heap instance refers to its own type only
            c = todo.pop()
            if c not in classes:
                classes.add(c)
                todo.extend(type.__subclasses__(c))
        alive = sum(1 for o in gc.get_referrers(*classes) if type(o) in classes)
        if alive:
            return f"{alive} torch.cuda.CUDAGraph object(s) alive"
    return None


_FINALIZERS = "_stacklens_cupti_finalizers"


def _finalizer(cupti_path, cudart_path):
    """The process's teardown callback for these libraries, kept in the ctypes module like the
    buffer callbacks (CUPTI may call a trampoline it still knows of after we detach)."""
    import ctypes
    kept = getattr(ctypes, _FINALIZERS, None)
    if kept is None:
        kept = {}
        setattr(ctypes, _FINALIZERS, kept)
    fin = kept.get((cupti_path, cudart_path))
    if fin is None:
        fin = kept[(cupti_path, cudart_path)] = _Finalizer(cupti_path, cudart_path)
    return fin


class _Finalizer:
    """cuptiSubscribe, one exit callback, and cuptiFinalize in it, through ctypes on the process's
    libcupti; the trigger is cudaRuntimeGetVersion through its libcudart (the callback runs on the
    calling thread, synchronously, so run() knows the outcome when the call returns unless
    another thread's call of the same API came first)."""

    def __init__(self, cupti_path, cudart_path):
        import ctypes
        self.ct = ctypes
        u32, vp, i32p = ctypes.c_uint32, ctypes.c_void_p, ctypes.POINTER(ctypes.c_int)
        self.CB = ctypes.CFUNCTYPE(None, vp, u32, u32, vp)
        self._cb = self.CB(self._callback)
        cupti, cudart = ctypes.CDLL(cupti_path), ctypes.CDLL(cudart_path)

        def fn(lib, name, *argtypes):
            f = getattr(lib, name)
            f.argtypes, f.restype = list(argtypes), ctypes.c_int
            return f
        self._version = fn(cupti, "cuptiGetVersion", ctypes.POINTER(u32))
        self._name = fn(cupti, "cuptiGetCallbackName", u32, u32, ctypes.POINTER(ctypes.c_char_p))
        self._subscribe = fn(cupti, "cuptiSubscribe", ctypes.POINTER(vp), self.CB, vp)
        self._enable = fn(cupti, "cuptiEnableCallback", u32, vp, u32, u32)
        self._unsubscribe = fn(cupti, "cuptiUnsubscribe", vp)
        self._fini = fn(cupti, "cuptiFinalize")
        self._driver_version = fn(cudart, "cudaDriverGetVersion", i32p)
        self._trigger = fn(cudart, "cudaRuntimeGetVersion", i32p)
        self._lock = threading.Lock()
        self._armed = False          # the next exit callback finalizes (taken by exactly one)
        self._sub = None
        self.done = threading.Event()
        self.rc = None               # cuptiFinalize's result

    def versions(self):
        """(CUPTI API version, driver version); 0 where the call failed."""
        ct = self.ct
        v, d = ct.c_uint32(0), ct.c_int(0)
        if self._version(ct.byref(v)) != 0:
            v.value = 0
        if self._driver_version(ct.byref(d)) != 0:
            d.value = 0
        return v.value, d.value

    def run(self, wait_s):
        """None once finalized, else (note level, why not); our subscriber never outlives it."""
        ct = self.ct
        name = ct.c_char_p()
        if self._name(RUNTIME_API, TRIGGER_CBID, ct.byref(name)) != 0 or \
                not (name.value or b"").startswith(b"cudaRuntimeGetVersion"):
            return "warning", f"runtime cbid {TRIGGER_CBID} is not cudaRuntimeGetVersion here ({name.value!r})"
        sub = ct.c_void_p()
        rc = self._subscribe(ct.byref(sub), self._cb, None)
        if rc == MULTIPLE_SUBSCRIBERS:
            return "info", "the user's profiler holds CUPTI's subscriber (Kineto keeps it once torch.profiler has run)"
        if rc != 0:
            return "warning", f"cuptiSubscribe returned {rc}"
        self._sub = sub
        self.done.clear()
        self.rc = None
        with self._lock:
            self._armed = True
        rc = self._enable(1, sub, RUNTIME_API, TRIGGER_CBID)
        if rc == 0:
            self._trigger(ct.byref(ct.c_int(0)))
        with self._lock:
            missed, self._armed = self._armed, False
        if missed:                   # no exit callback took it: leave CUPTI as it was
            self._enable(0, sub, RUNTIME_API, TRIGGER_CBID)
            urc = self._unsubscribe(sub)
            why = f"cuptiEnableCallback returned {rc}" if rc != 0 else "no exit callback of the runtime call"
            return "warning", why + ("" if urc == 0 else f" (and cuptiUnsubscribe returned {urc})")
        if not self.done.wait(wait_s):
            return "warning", f"cuptiFinalize had not returned after {wait_s:.0f} s"
        if self.rc != 0:
            return "warning", f"cuptiFinalize returned {self.rc}"
        return None

    def _callback(self, userdata, domain, cbid, cbdata):
        """CUPTI calls this at entry and exit of the enabled call, on the calling thread (GIL
        taken by ctypes). The first exit unsubscribes and finalizes; the lock is not held across
        the finalize, so a concurrent callback cannot wait on it from inside CUPTI."""
        try:
            if domain != RUNTIME_API or cbid != TRIGGER_CBID or not cbdata:
                return
            if self.ct.cast(cbdata, self.ct.POINTER(self.ct.c_uint32))[0] != API_EXIT:
                return
            with self._lock:
                mine, self._armed = self._armed, False
            if not mine:
                return
            try:
                self._unsubscribe(self._sub)
                self.rc = self._fini()
            finally:
                self.done.set()
        except BaseException:
            pass
