"""CUPTI's activity records as cupti-python objects -> the agent's wire rows (part of ``CuptiCollector``).

Runs in the target, on CUPTI's thread holding the GIL the target's own threads want: one pass per
record, only where records go through cupti-python (API records on, or no ctypes callbacks;
``cupti_raw.py`` says why that path costs the target more than raw buffers). Row layouts are the
daemon's wire format (``gpu/__init__.py``), decoded by ``stacklens.inject.channel.gpu.rows``; times
are CLOCK_MONOTONIC ns (the collector's clock offset added).
"""

import threading

# ActivityMemcpyKind / ActivitySynchronizationType member names -> the wire's names
# (``MEMCPY_KINDS`` also names the copy kinds of the raw layout, ``cupti_raw.py``)
MEMCPY_KINDS = {"HTOD": "HtoD", "DTOH": "DtoH", "DTOD": "DtoD", "HTOH": "HtoH", "PTOP": "PtoP"}
SYNC_TYPES = {"EVENT_SYNCHRONIZE": "event", "STREAM_WAIT_EVENT": "stream_wait_event",
              "STREAM_SYNCHRONIZE": "stream", "CONTEXT_SYNCHRONIZE": "context"}


class RecordRows:
    """The collector's record conversion, mixed into ``CuptiCollector`` (its ``__init__`` sets the
    state used here: ``_lib``, ``clock``, ``counts``, ``_names``, ``_codes``, ``_system_tids``,
    ``_thread_ids``, ``_unknown_tids``)."""

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
                        kind = MEMCPY_KINDS.get(lib.ActivityMemcpyKind(r.copy_kind).name, "other")
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
                        typ = SYNC_TYPES.get(lib.ActivitySynchronizationType(r.type).name, "other")
                    except Exception:
                        typ = "other"
                    yield "sync", [typ, max(0, r.start + off), max(0, max(r.end, r.start) + off),
                                   int(r.stream_id) & ((1 << 63) - 1), int(r.correlation_id)]
                else:
                    counts["unknown"] += 1
        finally:
            counts["kernel"] += n_kernel
            counts["api"] += n_api
