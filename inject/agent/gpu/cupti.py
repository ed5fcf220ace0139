# long: runs inside users' processes; split it only with the GPU safety matrix run (docs/agent-in-target.md)
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
Binding: cupti-python must resolve to the libcupti already mapped in the process; if importing
it maps a second copy we stop and say so (two CUPTI instances fight over the driver's hooks).

Raw buffers (the default without API records): cupti-python builds one Python object per record on
CUPTI's thread while holding the GIL the job needs (measured on the H200: 1.2-1.3x on ViT and
ResNet-50 with kernel records only). Instead the buffer callbacks are registered through ctypes on
the same libcupti and each completed buffer is copied out as bytes, untouched; the daemon parses it
with the record layout taken from cupti-python's dtypes (inject/agent/wire.py, daemon side
inject/channel/gpu/cupti.py). The first buffers are walked with cuptiActivityGetNextRecord to check
that records follow each other by their layout size; if they do not, every buffer carries its
record offsets. The ctypes trampolines are never freed (CUPTI may call them after we detach): one
set per process, reused by later attaches; so is the teardown's callback (``_Finalizer``).

Records leave this collector three ways (``gpu/__init__.py`` lists them; decoder:
``stacklens.inject.channel.gpu.cupti``): JSON rows from cupti-python's objects (``convert``: API
records on, or no ctypes callbacks), raw buffer copies (``_raw_buffer``: while verifying, or more
than ``max_shipped`` buffers out), and buffers left in place for the daemon to read (``_raw_ref``).
"""

import array
import os
import sys
import threading
import time

# a module of the agent ("gpu", "wire"), through this package's parent (loaded before it)
_agent = sys.modules[__name__.rpartition(".")[0]].agent_module

BUFFER_SIZE = 1 << 20
RAW_ALIGN = 8
VERIFY_BUFFERS = 3
FLUSH_PERIOD_MS = 1000
CALIBRATE_EVERY_NS = 10_000_000_000
PROFILER_CHECK_EVERY_NS = 1_000_000_000
MAX_CBID = 2048
FINALIZE_MIN_CUPTI = 24          # CUPTI API version of CUDA 12.6 (cupti_version.h)
FINALIZE_MIN_DRIVER = 12060      # cudaDriverGetVersion of CUDA 12.6
FINALIZE_WAIT_S = 2.0            # for a finalize another thread's exit callback has begun
RUNTIME_API = 2                  # CUPTI_CB_DOMAIN_RUNTIME_API
API_EXIT = 1                     # CUpti_CallbackData.callbackSite, its first field
TRIGGER_CBID = 2                 # CUPTI_RUNTIME_TRACE_CBID_cudaRuntimeGetVersion_v3020 (checked by name)
MULTIPLE_SUBSCRIBERS = 39        # CUPTI_ERROR_MULTIPLE_SUBSCRIBERS_NOT_SUPPORTED

_MEMCPY = {"HTOD": "HtoD", "DTOH": "DtoH", "DTOD": "DtoD", "HTOH": "HtoH", "PTOP": "PtoP"}
_SYNC = {"EVENT_SYNCHRONIZE": "event", "STREAM_WAIT_EVENT": "stream_wait_event",
         "STREAM_SYNCHRONIZE": "stream", "CONTEXT_SYNCHRONIZE": "context"}


def _import_cupti():
    from cupti import cupti  # optional dependency, feature-detected
    return cupti


class CuptiCollector:
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

    # -- raw buffers ----------------------------------------------------------------------------
    def _register_raw(self):
        """Register ctypes buffer callbacks and send the record layout; None to use cupti-python's."""
        try:
            layout = self._layout()
            if self._raw_factory is not None:
                cb = self._raw_factory(self._raw_buffer, self.wants_offsets)
            else:
                if not self._cupti_paths:   # resumed after a user's profiler: look again
                    self._cupti_paths = sorted(p for p in (self._gpu or _agent("gpu")).mapped_libraries()
                                               if "libcupti" in os.path.basename(p))
                if not self._cupti_paths:
                    raise OSError("libcupti is not mapped")
                cb = _ctypes_callbacks(self._cupti_paths[0], self._raw_buffer, self.wants_offsets)
        except Exception as e:
            self.note("warning", f"CUPTI raw buffers off ({type(e).__name__}: {e}): records go through "
                                 "cupti-python (higher overhead)")
            return None
        self._verified = 0
        if hasattr(cb, "on_ref"):
            cb.shipped = self._shipped   # the same dict on a resume; a new attach, a new dict
            cb.max_shipped = self.max_shipped
            cb.on_ref = self._raw_ref if self.ref else None
        self.sink("cupti_layout", layout)
        return cb

    def _layout(self):
        """The wire layout of kernel/memcpy/memset records, from cupti-python's record dtypes."""
        lib = self._lib
        K = lib.ActivityKind
        wire = _agent("wire")
        dtypes = {"kernel": lib.activity_kernel10_dtype, "memcpy": lib.activity_memcpy6_dtype,
                  "memset": lib.activity_memset4_dtype}
        kinds = {}
        for rec, codes in (("kernel", (K.CONCURRENT_KERNEL,)), ("memcpy", (K.MEMCPY,)),
                           ("memset", (K.MEMSET,))):
            dt = dtypes[rec]
            by_norm = {n.replace("_", "").lower(): n for n in dt.names}
            fields = {}
            for want in wire.RAW_FIELDS[rec] + wire.RAW_OPTIONAL_FIELDS[rec]:
                n = by_norm.get(want.replace("_", "").lower())
                if n is None:
                    if want in wire.RAW_OPTIONAL_FIELDS[rec]:
                        continue
                    raise KeyError(f"{rec} record has no field {want}")
                fdt, off = dt.fields[n][:2]
                fmt = {("u", 1): "B", ("u", 2): "H", ("u", 4): "I", ("u", 8): "Q", ("i", 1): "b",
                       ("i", 2): "h", ("i", 4): "i", ("i", 8): "q"}.get((fdt.kind, fdt.itemsize))
                if fmt is None and want == "name" and fdt.itemsize == 8:
                    fmt = "Q"                          # a char* however the binding types it
                if fmt is None:
                    raise TypeError(f"{rec}.{want} has dtype {fdt}")
                fields[want] = [int(off), fmt]
            for code in codes:
                kinds[str(int(code))] = {"rec": rec, "size": int(dt.itemsize), "fields": fields}
        copy_kinds = {}
        for m in lib.ActivityMemcpyKind:
            name = _MEMCPY.get(m.name)
            if name:
                copy_kinds[str(int(m))] = name
        memory_kinds = {}
        for m in getattr(lib, "ActivityMemoryKind", ()):   # "DEVICE_STATIC" -> "Device Static"
            name = m.name.replace("_", " ").title()
            if name in wire.RAW_MEMORY_KINDS:
                memory_kinds[str(int(m))] = name
        self._raw_sizes = {int(k): v["size"] for k, v in kinds.items()}
        return {"t": "cupti_layout", "kinds": kinds, "copy_kinds": copy_kinds, "memory_kinds": memory_kinds}

    def _raw_buffer(self, data, offsets):
        """A completed buffer's valid bytes (CUPTI's thread, GIL held). Once the layout walk is
        verified no per-record work is done here; until then (or for good, if the walk disagrees
        with cuptiActivityGetNextRecord) `offsets` holds the record offsets and travels along."""
        try:
            self.counts["buffers"] += 1
            self.counts["raw_bytes"] += len(data)
            sink = self.sink
            if sink is None or not data:
                return
            head = self._raw_head()
            if offsets is None:                   # verified: the callbacks did not walk it
                sink("raw", (head, data))
                return
            if self._verified < VERIFY_BUFFERS:
                if offsets == _walk_sizes(data, self._raw_sizes):
                    self._verified += 1
                else:
                    self._verified = VERIFY_BUFFERS + 1    # for good: offsets with every buffer
                    self.note("warning", "CUPTI records are not laid out by their sizes: record "
                                         "offsets travel with every buffer")
            offs = array.array("I", offsets)
            if sys.byteorder != "little":
                offs.byteswap()
            head["mode"], head["n_offs"] = "offsets", len(offs)
            sink("raw", (head, offs.tobytes() + data))
        except BaseException:
            pass

    def _raw_head(self):
        """The header of a buffer in mode "sizes" (wire.py); mode "offsets" sets two fields."""
        return {"t": "cupti_raw", "off_ns": self.clock.offset_ns, "mode": "sizes", "n_offs": 0,
                "align": RAW_ALIGN}

    def _raw_ref(self, addr, valid):
        """A completed, verified buffer left in place (CUPTI's thread, GIL held): only its address
        and length travel; the daemon reads it from /proc/PID/mem and hands it back (``free``).
        No copy of the buffer and no bulk socket writes in the target. True if taken."""
        try:
            sink = self.sink
            if sink is None:
                return False
            self.counts["buffers"] += 1
            self.counts["raw_bytes"] += valid
            self.counts["ref_buffers"] = self.counts.get("ref_buffers", 0) + 1
            head = self._raw_head()
            sink("rawref", (head, addr, valid))
            return True
        except BaseException:
            return False

    def release(self, addrs):
        """Buffers the daemon has read (its ``free`` message) go back to the pool."""
        cb = self._raw_cb
        if cb is not None and hasattr(cb, "release"):
            cb.release(addrs)

    def shipped(self):
        """How many buffers are left in place, not yet read and freed by the daemon."""
        return len(self._shipped)

    def drop_shipped(self):
        """At detach, after waiting for the daemon: buffers it has not freed may still be read
        (a daemon far behind), so they are not freed but parked on the process's callbacks
        until the next attach replaces them (at most max_shipped buffers)."""
        cb = self._raw_cb
        if cb is not None and self._shipped:
            cb.orphans = dict(self._shipped)
        self._shipped.clear()

    @property
    def raw_mode(self):
        """"sizes" once VERIFY_BUFFERS buffers walked by layout size matched CUPTI's own walk."""
        return "sizes" if self._verified == VERIFY_BUFFERS else "offsets"

    def wants_offsets(self):
        """Whether the callbacks walk the next buffer with cuptiActivityGetNextRecord."""
        return self._verified != VERIFY_BUFFERS

    # -- CUPTI callbacks (CUPTI's thread, holding the GIL) ---------------------------------------
    def _buffer_requested(self):
        return BUFFER_SIZE, 0

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

    def _tid(self, thread_id):
        if self._system_tids:
            return thread_id & 0x7FFFFFFF
        m = self._thread_ids
        if m is None or (thread_id not in m and thread_id not in self._unknown_tids):
            m = self._thread_ids = {t.ident: (t.native_id or 0) for t in threading.enumerate()}
            if thread_id not in m and len(self._unknown_tids) < 4096:
                self._unknown_tids.add(thread_id)  # a C++ thread (autograd, NCCL): no Python ident
        return m.get(thread_id, 0) & 0x7FFFFFFF

    def _api_name(self, runtime, cbid):
        """Callback name of an API record (cached in self._names by (runtime, cbid))."""
        lib = self._lib
        domain = lib.CallbackDomain.RUNTIME_API if runtime else lib.CallbackDomain.DRIVER_API
        try:
            n = str(lib.get_callback_name(domain, int(cbid)))[:256]
        except Exception:
            n = f"cbid_{cbid}"
        self._names[(runtime, cbid)] = n
        return n

    def _kind_codes(self):
        """ActivityKind members as plain ints, looked up once (enum attribute access per record
        costs more than the record's own fields)."""
        codes = self._codes
        if codes is None:
            K = self._lib.ActivityKind
            def code(name):
                m = getattr(K, name, None)
                return int(m) if m is not None else -1
            codes = self._codes = {
                "kernel": {code("CONCURRENT_KERNEL"), code("KERNEL")} - {-1},
                "runtime": code("RUNTIME"), "driver": code("DRIVER"), "memcpy": code("MEMCPY"),
                "memset": code("MEMSET"), "sync": code("SYNCHRONIZATION"),
            }
        return codes

    def convert(self, activities):
        """Activity objects -> (kind, wire row). Pure apart from name/thread caches.

        The hot loop of the collector (one pass per record, on CUPTI's thread holding the GIL the
        target's own threads want): plain-int kind codes, bound locals, one attribute read per field."""
        lib = self._lib
        codes = self._kind_codes()
        kernel_kinds, rt, drv = codes["kernel"], codes["runtime"], codes["driver"]
        mc, ms, sy = codes["memcpy"], codes["memset"], codes["sync"]
        off = self.clock.offset_ns
        counts = self.counts
        n_kernel = n_api = 0
        api_names = self._names
        system = self._system_tids
        tid_of = self._tid
        try:
            for r in activities:
                k = int(r.kind)
                if k in kernel_kinds:
                    start, end = r.start, r.end
                    if not end or end < start:
                        counts["unknown"] += 1
                        continue
                    n_kernel += 1
                    yield "kernel", [str(r.name)[:8192], max(0, start + off), max(0, end + off), r.device_id,
                                     r.stream_id, r.correlation_id, r.grid_x, r.grid_y, r.grid_z,
                                     r.block_x, r.block_y, r.block_z, getattr(r, "graph_id", 0) or 0,
                                     getattr(r, "graph_node_id", 0) or 0]
                elif k == rt or k == drv:
                    n_api += 1
                    cbid = r.cbid
                    runtime = k == rt
                    name = api_names.get((runtime, cbid)) or self._api_name(runtime, cbid)
                    start, end = r.start, r.end
                    tid = (r.thread_id & 0x7FFFFFFF) if system else tid_of(int(r.thread_id))
                    yield "api", ["runtime" if runtime else "driver", name, tid, max(0, start + off),
                                  max(0, (end if end > start else start) + off), r.correlation_id, cbid]
                elif k == mc:
                    counts["memcpy"] += 1
                    try:
                        kind = _MEMCPY.get(lib.ActivityMemcpyKind(r.copy_kind).name, "other")
                    except Exception:
                        kind = "other"
                    yield "memcpy", [kind, int(r.bytes), max(0, r.start + off), max(0, max(r.end, r.start) + off),
                                     int(r.device_id), int(r.stream_id), int(r.correlation_id)]
                elif k == ms:
                    counts["memcpy"] += 1
                    yield "memcpy", ["memset", int(r.bytes), max(0, r.start + off), max(0, max(r.end, r.start) + off),
                                     int(r.device_id), int(r.stream_id), int(r.correlation_id)]
                elif k == sy:
                    counts["sync"] += 1
                    try:
                        typ = _SYNC.get(lib.ActivitySynchronizationType(r.type).name, "other")
                    except Exception:
                        typ = "other"
                    yield "sync", [typ, max(0, r.start + off), max(0, max(r.end, r.start) + off),
                                   int(r.stream_id) & ((1 << 63) - 1), int(r.correlation_id)]
                else:
                    counts["unknown"] += 1
        finally:
            counts["kernel"] += n_kernel
            counts["api"] += n_api


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


def _walk_sizes(data, sizes):
    """Record offsets of a buffer walked by layout size (None where a kind is not in the layout)."""
    out = []
    off, n = 0, len(data)
    while off + 4 <= n:
        size = sizes.get(int.from_bytes(data[off:off + 4], "little"))
        if size is None:
            return None
        out.append(off)
        off = (off + size + RAW_ALIGN - 1) & ~(RAW_ALIGN - 1)
    return out


_KEEPALIVE = "_stacklens_cupti_raw_callbacks"


def _ctypes_callbacks(path, on_buffer, want_offsets):
    """The process's one set of ctypes CUPTI buffer callbacks (kept for the process's lifetime in
    the ctypes module, so a later attach reuses them), registered now with on_buffer as target."""
    import ctypes
    cb = getattr(ctypes, _KEEPALIVE, None)
    if cb is None or cb.path != path:
        cb = _RawCallbacks(path)
        setattr(ctypes, _KEEPALIVE, cb)   # never freed: CUPTI may call the trampolines later
    cb.on_buffer, cb.want_offsets = on_buffer, want_offsets
    cb.register()
    return cb


class _RawCallbacks:
    """cuptiActivityRegisterCallbacks through ctypes. Buffers are 8-byte aligned ctypes arrays kept
    alive between request and completion; a completed buffer is copied out with one memcpy."""

    def __init__(self, path):
        import ctypes
        self.ct = ctypes
        self.path = path
        self.dll = ctypes.CDLL(path)
        vp, sz = ctypes.c_void_p, ctypes.c_size_t
        self.REQ = ctypes.CFUNCTYPE(None, ctypes.POINTER(vp), ctypes.POINTER(sz), ctypes.POINTER(sz))
        self.DONE = ctypes.CFUNCTYPE(None, vp, ctypes.c_uint32, vp, sz, sz)
        self._req = self.REQ(self._requested)
        self._done = self.DONE(self._completed)
        self._reg = self.dll.cuptiActivityRegisterCallbacks
        self._reg.argtypes, self._reg.restype = [self.REQ, self.DONE], ctypes.c_int
        self._next = self.dll.cuptiActivityGetNextRecord
        self._next.argtypes, self._next.restype = [vp, sz, ctypes.POINTER(vp)], ctypes.c_int
        self._flush = self.dll.cuptiActivityFlushAll
        self._flush.argtypes, self._flush.restype = [ctypes.c_uint32], ctypes.c_int
        self._live = {}       # address -> buffer object, between request and completion
        self._free = []
        self.shipped = {}     # address -> buffer left in place for the daemon to read (cupti_ref)
        self.orphans = {}     # left in place by a detached session, never freed: kept alive
        self.on_ref = None    # (address, valid) -> bool: takes a verified buffer in place
        self.max_shipped = 64
        self.on_buffer = None
        self.want_offsets = None   # callable -> bool (the collector's wants_offsets)

    def register(self):
        rc = self._reg(self._req, self._done)
        if rc != 0:
            raise OSError(f"cuptiActivityRegisterCallbacks returned {rc}")

    def flush_all(self, flag):
        self._flush(flag)

    def _requested(self, buf_pp, size_p, max_p):
        try:
            ct = self.ct
            b = self._free.pop() if self._free else (ct.c_uint64 * (BUFFER_SIZE // 8))()
            addr = ct.addressof(b)
            self._live[addr] = b
            buf_pp[0] = addr
            size_p[0] = BUFFER_SIZE
            max_p[0] = 0
        except BaseException:
            try:
                size_p[0] = 0
            except BaseException:
                pass

    def release(self, addrs):
        for a in addrs:
            b = self.shipped.pop(a, None)
            if b is not None and len(self._free) < 4:
                self._free.append(b)

    def _completed(self, ctx, stream_id, buf, size, valid):
        try:
            b = self._live.pop(buf, None)
            target = self.on_buffer
            if valid and target is not None:
                want = self.want_offsets
                verifying = want is not None and want()
                ref = self.on_ref
                shipped = self.shipped
                if ref is not None and b is not None and not verifying and len(shipped) < self.max_shipped:
                    shipped[buf] = b           # before the address leaves: a quick free finds it
                    if ref(buf, valid):
                        return                 # the daemon reads it in place, then frees it
                    shipped.pop(buf, None)
                ct = self.ct                   # copied: verifying, or too many left in place
                data = ct.string_at(buf, valid)
                offsets = None
                if verifying:
                    offsets = []
                    rec = ct.c_void_p()
                    nxt = self._next
                    while nxt(buf, valid, ct.byref(rec)) == 0 and rec.value:
                        offsets.append(rec.value - buf)
                target(data, offsets)
            if b is not None and len(self._free) < 4:
                self._free.append(b)
        except BaseException:
            pass


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
