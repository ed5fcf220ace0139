"""CUPTI's activity buffers shipped as bytes: ctypes buffer callbacks (part of ``CuptiCollector``).

Runs in the target: the completion callback on CUPTI's thread holding the GIL; no per-record work
once the size walk is verified. Costs one memcpy per completed buffer copied out, none for a
buffer left in place (only its address and length travel).

Raw buffers (the default without API records): cupti-python builds one Python object per record on
CUPTI's thread while holding the GIL the job needs (measured on the H200: 1.2-1.3x on ViT and
ResNet-50 with kernel records only). Instead the buffer callbacks are registered through ctypes on
the same libcupti and each completed buffer is copied out as bytes, untouched; the daemon parses it
with the record layout taken from cupti-python's dtypes (inject/agent/wire.py, daemon side
inject/channel/gpu/cupti.py). The first buffers are walked with cuptiActivityGetNextRecord to check
that records follow each other by their layout size; if they do not, every buffer carries its
record offsets. The ctypes trampolines are never freed (CUPTI may call them after we detach): one
set per process, reused by later attaches; so is the teardown's callback (``_Finalizer`` in
``cupti_teardown.py``).
"""

import array
import os
import sys

# a module of the agent ("gpu", "wire"), through this package's parent (loaded before it)
_agent = sys.modules[__name__.rpartition(".")[0]].agent_module

BUFFER_SIZE = 1 << 20
RAW_ALIGN = 8
VERIFY_BUFFERS = 3


class RawBuffers:
    """The collector's raw-buffer path, mixed into ``CuptiCollector`` (its ``__init__`` sets the
    state used here: ``_raw_factory``, ``_raw_cb``, ``_raw_sizes``, ``_verified``, ``_shipped``,
    ``max_shipped``, ``ref``, ``_cupti_paths``, ``_lib``, ``_gpu``, ``sink``, ``clock``, ``counts``,
    ``note``)."""

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
        memcpy_kinds = _agent("gpu.cupti_rows").MEMCPY_KINDS
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
            name = memcpy_kinds.get(m.name)
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
