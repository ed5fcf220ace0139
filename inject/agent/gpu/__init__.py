"""The GPU collectors of the agent, one module per vendor, and the choice among them (stdlib only).

One module per vendor in this folder (``cupti.py``, ``rocm.py``; a collector grown past one file
keeps its parts beside it: ``cupti_raw.py``, ``cupti_rows.py``, ``cupti_teardown.py``), listed in
``COLLECTORS`` with the libraries that pick it; the daemon side of each is
``stacklens.inject.channel.gpu.<vendor>`` (its decoder) and ``stacklens.inject.channel.gpu.VENDORS``
declares what each supports (which join, raw buffers). Adding a vendor: a module here, a row in
``COLLECTORS``, a decoder and a ``VENDORS`` entry there. This package is loaded by the agent's
``_sub`` (``_sub("gpu")``, ``_sub("gpu.cupti")``): a collector imports nothing of the daemon and
reaches its siblings (``gpu``, ``wire``, its own parts: ``gpu.cupti_raw``) through
``agent_module()``.

A collector pushes rows into ``sink(kind, row)`` (kinds "kernel", "api", "memcpy", "sync"; row
layouts are the daemon's wire format, times already CLOCK_MONOTONIC ns). ``sink`` never blocks.
``poll()`` runs on the agent thread between flushes; ``stop()`` disables activities and flushes,
then leaves the vendor library as it found it where it can (CUPTI: cuptiFinalize at detach, where
``cupti.py`` says it is safe; a later attach initialises CUPTI again).

How kernel / memcpy / memset records travel to the daemon (three ways, all in ``wire.py``):
1. JSON rows: ``{"t": "kernel"|"memcpy"|"api"|"sync", "r": [rows]}``, built in the target from
   the vendor's records (ROCm always; CUPTI through cupti-python when API records are on or the
   ctypes callbacks could not be registered); decoded by ``stacklens.inject.channel.gpu.rows``.
2. Raw buffer copies (CUPTI only): a completed activity buffer copied into a raw frame
   (``cupti_raw``, after one ``cupti_layout``), while the size walk is verified or when too many
   buffers are out; decoded by ``stacklens.inject.channel.gpu.cupti``.
3. Raw buffers read in place (CUPTI only): ``cupti_ref`` (address, length) travels, the daemon
   reads the bytes from /proc/PID/mem, decodes them as in 2, and answers ``free``.
"""

import os
import sys
import time


def agent_module(name):
    """A module of the agent ("gpu", "wire"): this package is ``<agent>.gpu``, and the agent's own
    ``_sub`` loads its modules (compiled from source when injected, imported in tests)."""
    pkg = __name__.rpartition(".")[0]
    mod = sys.modules.get(pkg + "." + name)
    if mod is None:
        load = getattr(sys.modules.get(pkg), "_sub", None)
        if load is None:
            import importlib
            return importlib.import_module(pkg + "." + name)
        mod = load(name)
    return mod


class Protocol:
    """Stand-in for typing.Protocol: importing typing into the target costs ~100 GIL handoffs."""


class GpuCollector(Protocol):
    name: str

    def start(self, sink) -> bool: ...
    def poll(self) -> None: ...
    def stop(self) -> None: ...
    def stats(self) -> dict: ...


def mapped_libraries():
    """Paths of the shared objects mapped in this process (our own /proc/self/maps)."""
    out = set()
    try:
        with open("/proc/self/maps") as fh:
            for line in fh:
                parts = line.split(None, 5)
                if len(parts) == 6 and ".so" in parts[5]:
                    out.add(parts[5].strip())
    except OSError:
        pass
    return out


def user_profiler_active(maps=True):
    """Name of a profiler of the user's own that owns the GPU tracing library, or None.

    ``maps=False`` skips reading /proc/self/maps: the periodic check runs on the target's GIL
    every second, and a CUDA process has thousands of mappings. Nsight injects itself at process
    start (its environment and library are already there at attach), so once is enough for it.
    ``maps`` may also be the mapped libraries the caller has just read (``mapped_libraries()``)."""
    env = os.environ
    if env.get("NSYS_PROFILING_SESSION_ID") or "ToolsInjection" in env.get("CUDA_INJECTION64_PATH", ""):
        return "Nsight Systems"
    if env.get("NV_COMPUTE_PROFILER_PERFWORKS_DIR") or env.get("NV_NSIGHT_INJECTION_TRANSPORT_TYPE"):
        return "Nsight Compute"
    libs = mapped_libraries() if maps is True else (maps or ())
    if any("ToolsInjection" in p for p in libs):
        return "Nsight"
    torch = sys.modules.get("torch")
    if torch is not None:
        try:
            if torch._C._autograd._profiler_enabled():
                return "torch.profiler"
        except Exception:
            pass
        if env.get("KINETO_USE_DAEMON") == "1":
            return "Kineto on-demand (KINETO_USE_DAEMON=1)"
    jax_prof = sys.modules.get("jax._src.profiler")
    if jax_prof is not None:
        try:
            if getattr(jax_prof._profile_state, "profile_session", None) is not None:
                return "jax.profiler"
        except Exception:
            pass
    return None


class ClockCalibration:
    """Offset between a device-tracing clock and CLOCK_MONOTONIC, from the tightest of n pairs."""

    def __init__(self, device_now, n=7, mono=time.monotonic_ns):
        self.device_now = device_now
        self.mono = mono
        self.n = n
        self.offset_ns = 0
        self.uncertainty_ns = 0
        self.calibrated_at = 0
        self.calibrate()

    def calibrate(self):
        best = None
        for _ in range(self.n):
            t1 = self.mono()
            d = self.device_now()
            t2 = self.mono()
            if best is None or t2 - t1 < best[0]:
                best = (t2 - t1, (t1 + t2) // 2 - d)
        self.uncertainty_ns = best[0] // 2
        self.offset_ns = best[1]
        self.calibrated_at = self.mono()

    def to_mono(self, t):
        return max(0, int(t) + self.offset_ns)


# vendor (its module in this folder and GpuCollector.name), collector class, library name prefixes
COLLECTORS = (
    ("cupti", "CuptiCollector", ("libcudart", "libcuda.so", "libcupti")),
    ("rocm", "RocmCollector", ("libamdhip64", "libroctracer64")),
)


def vendor_of(libraries):
    """The vendor of the first ``COLLECTORS`` row whose libraries are among these paths, or None."""
    names = {os.path.basename(p) for p in libraries}
    for vendor, _cls, prefixes in COLLECTORS:
        if any(n.startswith(prefixes) for n in names):
            return vendor
    return None


def select_collector(load, note, libraries=None):
    """A collector for the GPU runtime this process has loaded, or None (sampler only).
    ``load``: the agent's ``_sub``."""
    vendor = vendor_of(libraries if libraries is not None else mapped_libraries())
    for name, cls, _prefixes in COLLECTORS:
        if name == vendor:
            return getattr(load("gpu." + name), cls)(note)
    return None
