"""CUPTI collector through cupti-python: the activity API while attached, CUPTI torn down at detach.

Runs in the target. Kinds: CONCURRENT_KERNEL, MEMCPY, MEMSET, and RUNTIME/DRIVER API records
restricted to the launch, copy and memset calls (cbids whose name holds "Launch", "Memcpy" or
"Memset", not the graph-building cudaGraphAddMemcpyNode …): the join needs only those, and
PyTorch makes many cheap API calls per operator (cudaGetDevice, cuCtxGetCurrent, …) whose
records, turned into Python objects, cost the target far more than the kernels themselves
(measured on the H200: all API kinds made a GPT-2 step 11x slower). API records carry the
kernel thread id (CUPTI's SYSTEM thread-id type), the id BPF sees. Buffers are 1 MiB; poll()
asks CUPTI for completed buffers once a second (periodic_flush, the agent's gpu_flush) so records
arrive while the job runs. CUPTI's own 1 s flush period is also set but is not the same: it may
return only full buffers, so without periodic_flush a partly filled buffer waits until it fills
or until detach. A forced flush happens only at detach (a forced flush returns in-flight kernels
with end = 0, which are lost). Costs: CUPTI's own
per-launch overhead plus one Python call per completed buffer that turns records into tuples. On CUDA <= 13.2 CUPTI has one subscriber and global
buffer callbacks, so while attached we hold no subscriber (measured: holding one breaks the
user's torch.profiler, whose cuptiSubscribe then fails) and we yield when a profiler of the user's
own is active: activities disabled, a note sent, resumed when it has finished.

Detach (``stop``): activities disabled and a forced flush, then the teardown: cuptiFinalize, which
takes CUPTI's API hooks out of the process, where that is safe (``cupti_teardown.py`` says when
and why; a note says what happened). Costs one subscribe, one runtime call and the finalize, once
per detach.
Binding: cupti-python must resolve to the libcupti already mapped in the process; if importing
it maps a second copy we stop and say so (two CUPTI instances fight over the driver's hooks).

Records leave this collector three ways (``gpu/__init__.py`` lists them; decoder:
``stacklens.inject.channel.gpu.cupti``): JSON rows from cupti-python's objects (``convert`` in
``cupti_rows.py``: API records on, or no ctypes callbacks), raw buffer copies (``_raw_buffer`` in
``cupti_raw.py``: while verifying, or more than ``max_shipped`` buffers out), and buffers left in
place for the daemon to read (``_raw_ref``, ``cupti_raw.py``).

One collector, four files by concern: ``CuptiCollector`` here (its state, and the lifecycle:
start, enable, disable, poll, flush, stop, stats) mixes in ``RawBuffers`` (``cupti_raw.py``: the
ctypes buffer callbacks and the record layout), ``RecordRows`` (``cupti_rows.py``: cupti-python's
records to wire rows) and ``Teardown`` (``cupti_teardown.py``: cuptiFinalize at detach). The parts
are loaded like any module of the agent (``_agent``), when this one is.
"""

import os
import sys
import threading
import time

# a module of the agent ("gpu", "wire"), through this package's parent (loaded before it)
_agent = sys.modules[__name__.rpartition(".")[0]].agent_module
_raw = _agent("gpu.cupti_raw")
_rows = _agent("gpu.cupti_rows")
_teardown = _agent("gpu.cupti_teardown")

FLUSH_PERIOD_MS = 1000
CALIBRATE_EVERY_NS = 10_000_000_000
PROFILER_CHECK_EVERY_NS = 1_000_000_000
MAX_CBID = 2048


def _import_cupti():
    from cupti import cupti  # optional dependency, feature-detected
    return cupti


class CuptiCollector(_raw.RawBuffers, _rows.RecordRows, _teardown.Teardown):
    name = "cupti"

    def __init__(self, note, lib=None, gpu=None, thread_ids=None, raw_factory=None):
        self.note = note
        self._lib = lib                  # the cupti.cupti module, or a fake with the same surface
        self._gpu = gpu                  # the agent's gpu module (helpers), injected for tests
        self._thread_ids = thread_ids    # pthread ident -> native tid, default from threading
        self.sink = None
        self.enabled_kinds = []
        self.active = False
        self.yielded_to = None
        self.clock = None
        self.counts = {"kernel": 0, "api": 0, "memcpy": 0, "sync": 0, "buffers": 0, "unknown": 0,
                       "yields": 0, "raw_bytes": 0}   # raw path: records are counted by the daemon
        self._names = {}
        self._lock = threading.Lock()
        self._thread_id_type = None      # CUPTI's thread-id type before we set SYSTEM (restored)
        self._system_tids = False
        self._unknown_tids = set()
        self._next_check_ns = 0
        self._codes = None
        self.api_records = True          # False: kernel/copy activity only (the daemon joins by order)
        self.raw = True                  # without API records: ship CUPTI's buffers as bytes (ctypes)
        self.ref = True                  # raw: leave verified buffers in place, the daemon reads them
        self.periodic_flush = True       # poll() asks CUPTI for completed buffers (False: CUPTI's period
                                         # alone, which may return only full buffers: a partly filled one
                                         # waits until it fills or until detach)
        self.max_shipped = 64            # buffers left in place at once (64 MiB); beyond: copied
        self._shipped = {}               # this session's buffers left in place: address -> buffer
        self._stopped = False            # stop() ran: poll() never enables again
        self._raw_factory = raw_factory  # on_buffer -> object with flush_all(flag); None: the ctypes one
        self._raw_cb = None              # the registered raw callbacks while they are ours
        self._raw_sizes = {}             # record kind -> layout size (the size walk)
        self._verified = 0               # buffers whose size walk matched CUPTI's own walk
        self._cupti_paths = ()           # the libcupti files mapped when start() looked
        self.enabled_at_ns = 0
        self.finalize = True             # stop() finalizes CUPTI where allowed (the agent's gpu_finalize)
        self.finalized = 0               # detaches that finalized CUPTI

    # -- lifecycle -------------------------------------------------------------------------
    def start(self, sink):
        gpu = self._gpu or _agent("gpu")
        mapped = gpu.mapped_libraries()          # read once for both questions below
        who = gpu.user_profiler_active(maps=mapped)
        if who:
            self.note("warning", f"GPU collector yields: {who} is active in the target; "
                                 "only Python samples are collected")
            self.yielded_to = who
            self.counts["yields"] += 1
            self.sink = sink
            return True          # keep polling: resume when the user's profiler has finished
        before = {p for p in mapped if "libcupti" in os.path.basename(p)}
        if self._lib is None:
            try:
                self._lib = _import_cupti()
            except ImportError:
                self.note("info", "cupti-python is not installed in the target: GPU kernel times "
                                  "unavailable (pip install cupti-python matching the CUDA version)")
                return False
        after = {p for p in gpu.mapped_libraries() if "libcupti" in os.path.basename(p)}
        if before and len(after) > len(before):
            self.note("error", f"cupti-python loaded a second libcupti ({sorted(after - before)}) next "
                               f"to the process's own ({sorted(before)}); GPU collection disabled")
            return False
        self.sink = sink
        self._cupti_paths = sorted(after)
        return self._enable()

    def _enable(self):
        lib = self._lib
        self.clock = (self._gpu or _agent("gpu")).ClockCalibration(lib.get_timestamp)
        self._use_system_thread_ids()
        self._raw_cb = None
        if self.raw and not self.api_records:
            self._raw_cb = self._register_raw()
        if self._raw_cb is None:
            lib.activity_register_callbacks(self._buffer_requested, self._buffer_completed)
        K = lib.ActivityKind
        self.enabled_kinds = []
        self.enabled_at_ns = time.monotonic_ns()   # launches BPF saw before this have no records
        kinds = (K.CONCURRENT_KERNEL, K.MEMCPY, K.MEMSET) + ((K.RUNTIME, K.DRIVER) if self.api_records else ())
        for kind in kinds:
            try:
                lib.activity_enable(kind)
                self.enabled_kinds.append(kind)
            except Exception as e:
                self.note("warning", f"CUPTI activity {getattr(kind, 'name', kind)} not enabled: {e}")
        kept = self._restrict_api_records() if self.api_records else 0
        try:
            lib.activity_flush_period(FLUSH_PERIOD_MS)
        except Exception:
            pass
        self.active = bool(self.enabled_kinds)
        if self.active:
            self.note("info", f"CUPTI activity collection on ({len(self.enabled_kinds)} kinds, "
                              f"{f'{kept} launch APIs' if self.api_records else 'no API records: join by launch order'}, "
                              f"{'system' if self._system_tids else 'pthread'} thread ids, "
                              f"{'raw buffers' if self._raw_cb is not None else 'cupti-python records'}, "
                              f"clock offset {self.clock.offset_ns} ns +- {self.clock.uncertainty_ns} ns)")
        return self.active

    def _use_system_thread_ids(self):
        lib = self._lib
        try:
            self._thread_id_type = lib.get_thread_id_type()
            lib.set_thread_id_type(lib.ActivityThreadIdType.SYSTEM)
            self._system_tids = True
        except Exception:
            self._thread_id_type = None
            self._system_tids = False

    def _restrict_api_records(self):
        """Keep API records for launches, copies and memsets only (the calls whose activity the
        join charges); returns how many cbids stay on (-1: all, could not restrict)."""
        lib = self._lib
        kept = 0
        try:
            for domain, enable, cbdom in (
                ("driver", lib.activity_enable_driver_api, lib.CallbackDomain.DRIVER_API),
                ("runtime", lib.activity_enable_runtime_api, lib.CallbackDomain.RUNTIME_API),
            ):
                for cbid in range(1, MAX_CBID):
                    try:
                        name = str(lib.get_callback_name(cbdom, cbid))
                    except Exception:
                        continue
                    want = "Launch" in name or (("Memcpy" in name or "Memset" in name) and "Graph" not in name)
                    enable(cbid, 1 if want else 0)
                    kept += want
        except Exception as e:
            self.note("warning", f"CUPTI API records not restricted to launches ({e}): higher overhead")
            return -1
        return kept

    def _disable(self, flush=True):
        lib = self._lib
        for kind in self.enabled_kinds:
            try:
                lib.activity_disable(kind)
            except Exception:
                pass
        self.enabled_kinds = []
        try:
            lib.activity_flush_period(0)
        except Exception:
            pass
        if self._thread_id_type is not None:
            try:
                lib.set_thread_id_type(self._thread_id_type)
            except Exception:
                pass
            self._thread_id_type = None
        if flush:
            # Forced once, at the end only, so partly filled buffers come back; records of kernels
            # still running come back with end=0 and are dropped (counted as "unknown").
            self._flush_all(1)
        if self._raw_cb is not None:         # the trampolines stay registered (and alive), idle
            self._raw_cb.on_buffer = self._raw_cb.want_offsets = None
            if hasattr(self._raw_cb, "on_ref"):
                self._raw_cb.on_ref = None       # buffers left in place stay until freed
        self.active = False

    def _flush_all(self, flag):
        try:
            if self._raw_cb is not None:     # through ctypes: the GIL is released while CUPTI
                self._raw_cb.flush_all(flag)   # calls our completion callback on its thread
            else:
                self._lib.activity_flush_all(flag)
        except Exception:
            pass

    def poll(self):
        if self._stopped:
            return
        gpu = self._gpu or _agent("gpu")
        now = time.monotonic_ns()
        if now < self._next_check_ns:
            return
        self._next_check_ns = now + PROFILER_CHECK_EVERY_NS
        who = gpu.user_profiler_active(maps=False)
        if who and self.active:
            self._disable(flush=True)
            self.yielded_to = who
            self.counts["yields"] += 1
            self.note("warning", f"GPU collector yields: {who} started in the target")
        elif not who and self.yielded_to is not None:
            self.note("info", f"{self.yielded_to} finished: GPU collection resumes")
            self.yielded_to = None
            if self._lib is None:
                try:
                    self._lib = _import_cupti()
                except ImportError:
                    return
            self._enable()
        elif self.active:
            if self.clock.mono() - self.clock.calibrated_at > CALIBRATE_EVERY_NS:
                self.clock.calibrate()
            if self.periodic_flush:
                self._flush_all(0)

    def flush_now(self):
        """The daemon's window edge: CUPTI hands over every buffer now (a forced flush: records of
        kernels still in flight come back incomplete). Not while yielded to a user's profiler."""
        if self.active and not self._stopped:
            self._flush_all(1)

    def stop(self):
        self._stopped = True             # also while yielded: poll() must not enable again
        self.yielded_to = None
        if self.active:
            self._disable(flush=True)
            self._teardown()

    def stats(self):
        st = dict(self.counts)
        st["active"] = 1 if self.active else 0
        st["api_records"] = 1 if self.api_records else 0
        st["enabled_at_ns"] = self.enabled_at_ns
        st["raw"] = 1 if self._raw_cb is not None else 0
        st["raw_sizes_mode"] = 1 if self.raw_mode == "sizes" else 0
        st["finalized"] = self.finalized
        if self.clock is not None:
            st["clock_offset_ns"] = self.clock.offset_ns
            st["clock_uncertainty_ns"] = self.clock.uncertainty_ns
        return st

    # -- CUPTI callbacks (CUPTI's thread, holding the GIL) ---------------------------------------
    def _buffer_requested(self):
        return _raw.BUFFER_SIZE, 0

    def _buffer_completed(self, activities):
        try:
            self.counts["buffers"] += 1
            sink = self.sink
            if sink is None:
                return
            for row in self.convert(activities):
                sink(row[0], row[1])
        except BaseException:
            pass
