"""ROCm collector: roctracer's activity API through ctypes, behind a narrow library Protocol.

UNTESTED ON AMD HARDWARE: tested only against a fake ``RoctracerLib`` (tests/unit/test_rocm*.py).
Runs in the target; feature-detected (``libroctracer64.so`` must be loadable, HIP already mapped).
Domains: HIP_OPS (kernels, copies, barriers) and HIP_API (hip* calls). Kernel timestamps come
from roctracer's clock (``roctracer_get_timestamp``), calibrated against CLOCK_MONOTONIC like
CUPTI's. rocprofiler-sdk (ROCm 6.2+) only allows late attach when the job started with
``ROCP_TOOL_ATTACH=1``; that path is not implemented here (a note says so).
Detach disables the domains, flushes and closes the pool; nothing is left registered.
Records leave as JSON rows only (kernel, memcpy, sync, api with domain "hip"; decoder:
``stacklens.inject.channel.gpu.rocm``); HIP API records are always on, so the daemon joins through
them.
"""

import ctypes
import os
import sys

# a module of the agent ("gpu", "wire"), through this package's parent (loaded before it)
_agent = sys.modules[__name__.rpartition(".")[0]].agent_module


class Protocol:
    """Stand-in for typing.Protocol: importing typing into the target costs ~100 GIL handoffs."""

DOMAIN_HIP_OPS = 2
DOMAIN_HIP_API = 3
HIP_OP_DISPATCH, HIP_OP_COPY, HIP_OP_BARRIER = 0, 1, 2


class RoctracerLib(Protocol):
    """What the collector needs from roctracer (real: ``CtypesRoctracer``; tests: a fake)."""

    def open_pool(self, on_records) -> None: ...        # on_records(iterable of RecordView)
    def enable(self, domain: int) -> None: ...
    def disable(self, domain: int) -> None: ...
    def flush(self) -> None: ...
    def close_pool(self) -> None: ...
    def timestamp(self) -> int: ...
    def op_string(self, domain: int, op: int, kind: int) -> str: ...


class RecordView:
    """One activity record, decoded (what CtypesRoctracer yields and fakes construct)."""

    __slots__ = ("domain", "op", "kind", "correlation_id", "begin_ns", "end_ns", "device_id",
                 "queue_id", "thread_id", "bytes", "kernel_name")

    def __init__(self, domain, op, kind, correlation_id, begin_ns, end_ns, device_id=0, queue_id=0,
                 thread_id=0, bytes=0, kernel_name=""):
        self.domain, self.op, self.kind = domain, op, kind
        self.correlation_id, self.begin_ns, self.end_ns = correlation_id, begin_ns, end_ns
        self.device_id, self.queue_id, self.thread_id = device_id, queue_id, thread_id
        self.bytes, self.kernel_name = bytes, kernel_name


class _Record(ctypes.Structure):
    """roctracer_record_t (roctracer.h, ROCm 5/6)."""
    _fields_ = [("domain", ctypes.c_uint32), ("op", ctypes.c_uint32), ("kind", ctypes.c_uint32),
                ("correlation_id", ctypes.c_uint64), ("begin_ns", ctypes.c_uint64),
                ("end_ns", ctypes.c_uint64), ("u0", ctypes.c_uint64), ("u1", ctypes.c_uint64),
                ("u2", ctypes.c_uint64)]


class _Properties(ctypes.Structure):
    _BUFFER_CB = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p)
    _fields_ = [("mode", ctypes.c_uint32), ("buffer_size", ctypes.c_size_t),
                ("alloc_fun", ctypes.c_void_p), ("alloc_arg", ctypes.c_void_p),
                ("buffer_callback_fun", _BUFFER_CB), ("buffer_callback_arg", ctypes.c_void_p)]


class CtypesRoctracer:
    """The real library. Only constructed when libroctracer64 loads."""

    def __init__(self, path="libroctracer64.so"):
        self.lib = ctypes.CDLL(path)
        self.lib.roctracer_op_string.restype = ctypes.c_char_p
        self._cb = None

    def open_pool(self, on_records):
        size = ctypes.sizeof(_Record)

        def callback(begin, end, _arg):
            views = []
            p = begin
            while p < end:
                r = _Record.from_address(p)
                name = ""
                if r.domain == DOMAIN_HIP_OPS and r.op == HIP_OP_DISPATCH and r.u2:
                    name = ctypes.string_at(r.u2).decode(errors="replace")
                views.append(RecordView(r.domain, r.op, r.kind, r.correlation_id, r.begin_ns,
                                        r.end_ns, r.u0 & 0xFFFFFFFF, r.u1, (r.u0 >> 32) & 0xFFFFFFFF,
                                        r.u2 if r.op == HIP_OP_COPY else 0, name))
                p += size
            on_records(views)

        self._cb = _Properties._BUFFER_CB(callback)
        props = _Properties(0, 1 << 22, None, None, self._cb, None)
        self._check(self.lib.roctracer_open_pool_expl(ctypes.byref(props), None), "open_pool")

    def enable(self, domain):
        self._check(self.lib.roctracer_enable_domain_activity(domain), "enable")

    def disable(self, domain):
        self._check(self.lib.roctracer_disable_domain_activity(domain), "disable")

    def flush(self):
        self._check(self.lib.roctracer_flush_activity(), "flush")

    def close_pool(self):
        self._check(self.lib.roctracer_close_pool_expl(None), "close_pool")

    def timestamp(self):
        ts = ctypes.c_uint64()
        self._check(self.lib.roctracer_get_timestamp(ctypes.byref(ts)), "get_timestamp")
        return ts.value

    def op_string(self, domain, op, kind):
        s = self.lib.roctracer_op_string(domain, op, kind)
        return s.decode(errors="replace") if s else f"op_{op}"

    @staticmethod
    def _check(rc, what):
        if rc != 0:
            raise OSError(f"roctracer {what} failed: status {rc}")


class RocmCollector:
    name = "rocm"

    def __init__(self, note, lib=None, gpu=None):
        self.note = note
        self._lib = lib
        self._gpu = gpu
        self.sink = None
        self.active = False
        self.clock = None
        self.counts = {"kernel": 0, "api": 0, "memcpy": 0, "sync": 0, "buffers": 0, "unknown": 0}
        self._names = {}

    def start(self, sink):
        gpu = self._gpu or _agent("gpu")
        if self._lib is None:
            if os.environ.get("ROCP_TOOL_ATTACH") == "1":
                self.note("info", "rocprofiler-sdk late attach (ROCP_TOOL_ATTACH=1) is not implemented; "
                                  "trying roctracer")
            try:
                self._lib = CtypesRoctracer()
            except OSError:
                self.note("info", "libroctracer64 not found in the target: GPU kernel times unavailable")
                return False
        self.sink = sink
        lib = self._lib
        self.clock = gpu.ClockCalibration(lib.timestamp)
        lib.open_pool(self._on_records)
        for d in (DOMAIN_HIP_OPS, DOMAIN_HIP_API):
            lib.enable(d)
        self.active = True
        self.note("info", "ROCm (roctracer) activity collection on; untested on AMD hardware")
        return True

    def poll(self):
        if self.active:
            try:
                self._lib.flush()
            except Exception:
                pass

    def stop(self):
        if not self.active:
            return
        lib = self._lib
        for d in (DOMAIN_HIP_OPS, DOMAIN_HIP_API):
            try:
                lib.disable(d)
            except Exception:
                pass
        try:
            lib.flush()
        finally:
            try:
                lib.close_pool()
            except Exception:
                pass
            self.active = False

    def stats(self):
        st = dict(self.counts)
        st["active"] = 1 if self.active else 0
        return st

    def _on_records(self, records):
        try:
            self.counts["buffers"] += 1
            sink = self.sink
            for kind, row in self.convert(records):
                sink(kind, row)
        except BaseException:
            pass

    def _name(self, domain, op, kind):
        key = (domain, op, kind)
        n = self._names.get(key)
        if n is None:
            try:
                n = self._lib.op_string(domain, op, kind)
            except Exception:
                n = f"op_{op}"
            self._names[key] = n
        return n

    def convert(self, records):
        to = self.clock.to_mono
        for r in records:
            if r.end_ns < r.begin_ns:
                self.counts["unknown"] += 1
                continue
            if r.domain == DOMAIN_HIP_OPS and r.op == HIP_OP_DISPATCH:
                self.counts["kernel"] += 1
                yield "kernel", [str(r.kernel_name or "")[:8192], to(r.begin_ns), to(r.end_ns), int(r.device_id),
                                 int(r.queue_id), int(r.correlation_id), 0, 0, 0, 0, 0, 0, 0]
            elif r.domain == DOMAIN_HIP_OPS and r.op == HIP_OP_COPY:
                self.counts["memcpy"] += 1
                yield "memcpy", ["other", int(r.bytes), to(r.begin_ns), to(r.end_ns), int(r.device_id),
                                 int(r.queue_id), int(r.correlation_id)]
            elif r.domain == DOMAIN_HIP_OPS and r.op == HIP_OP_BARRIER:
                self.counts["sync"] += 1
                yield "sync", ["other", to(r.begin_ns), to(r.end_ns), int(r.queue_id), int(r.correlation_id)]
            elif r.domain == DOMAIN_HIP_API:
                name = self._name(r.domain, r.op, r.kind)
                self.counts["api"] += 1
                yield "api", ["hip", name[:256], int(r.thread_id) & 0x7FFFFFFF, to(r.begin_ns), to(r.end_ns),
                              int(r.correlation_id), int(r.op) & 0xFFFFF]
                if "Synchronize" in name:
                    self.counts["sync"] += 1
                    yield "sync", ["stream" if "Stream" in name else "event" if "Event" in name else "context",
                                   to(r.begin_ns), to(r.end_ns), 0, int(r.correlation_id)]
            else:
                self.counts["unknown"] += 1
