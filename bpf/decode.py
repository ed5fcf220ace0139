"""RingDecoder: the bytes of ring records -> `Event`s with symbolized native and Python frames.

The decoder walks the ring and makes the events (API calls, kernel names, allocations, CPU
samples, autograd nodes, operator paths) and keeps the notes on what could not be decoded; a
record's native stack is bpf/native_stacks.py's (NativeStacks, `native_frames`), its Python stack
bpf/py_stacks.py's (PyStacks). `RecordList` lays records held apart from the ring out like it.

No privilege and no BCC: everything it reads from outside the records comes in through its
constructor behind narrow Protocols (`DecodeMaps` for the BPF maps, the native and Python
symbolizers, which read the target through `ProcessMemory` and `ProcFS`), so it runs on fakes in
tests/unit and on recorded rings in tests/replay. Overhead: one struct unpack per record and
cached stacks, op paths and Python stacks: 2.5-4.5 µs of CPU per event on the busy 2-vCPU VM
(`benchmarks/bench_decode.py --rings 1500`).
"""

from __future__ import annotations

import logging
import os
import struct
import time
from typing import Protocol

from stacklens.bpf import autograd
from stacklens.bpf.events_abi import (SL_BLOB, SL_EV_NAME, SL_EV_NODE_NEW, SL_EV_SAMPLE, SL_NAME, SL_NARGS,
                                      SL_STACK_INLINE, SlEvent)
from stacklens.bpf.native_stacks import (EVENT_SIZE, STACK_DEPTH, TRUNCATED, TRUNCATED_STACK, AddressNames,
                                         NativeStacks, StackMaps, native_frames)
from stacklens.bpf.py_stacks import PY_MAX_DEPTH, PY_UNDECODABLE, PyFrames, PyStackMaps, PyStacks
from stacklens.bpf.ringbuf import BUSY, DISCARD
from stacklens.bpf.spec import MEMCPY_KINDS, ProbeSpec
from stacklens.records.events import Event, make_event

log = logging.getLogger(__name__)
_HEAD = struct.Struct("<IIIIQQQIiQQQQQ")  # sl_event up to `args` (checked against SlEvent below)
_ARGS = struct.Struct(f"<{SL_NARGS}Q")
_ARGS_OFF = SlEvent.args.offset
_BLOB_OFF = SlEvent.blob.offset
assert _HEAD.size == _ARGS_OFF and _ARGS_OFF + _ARGS.size == _BLOB_OFF
_NAME_HEAD = struct.Struct("<IIIIQQ")
# ring record header (length | BUSY | DISCARD, page offset) + the sl_event head: one unpack per record
_REC = struct.Struct("<II" + _HEAD.format[1:])
_ARGS_REC = 8 + _ARGS_OFF
_BLOB_REC = 8 + _BLOB_OFF
COMMIT_BYTES = 1 << 20  # consumer position handed back to the producers at least this often
_RING_HDR = struct.Struct("<II")
_tuple_new = tuple.__new__  # Event is a tuple subclass (records/events.py)
_NO_ARGS: dict = {}  # shared by every sample (Event.args is read-only by contract)
_U64 = struct.Struct("<Q")
UNDECODABLE_KEEP = 4  # distinct "what raised" texts kept for the notes (the first ones)
COUNTS = ("decoded", "truncated_stacks", "stack_lookup_failures", "py_stacks_symbolized", "py_stacks_lost",
          "py_stacks_undecodable", "records_undecodable")
# re-exported (`__all__`): tests and benchmarks import the stack parts' names from here
__all__ = ["RingDecoder", "RecordList", "DecodeMaps", "AddressNames", "PyFrames", "VtableNamer", "COUNTS",
           "COMMIT_BYTES", "UNDECODABLE_KEEP", "EVENT_SIZE", "STACK_DEPTH", "TRUNCATED", "TRUNCATED_STACK",
           "native_frames", "PY_MAX_DEPTH", "PY_UNDECODABLE"]


class DecodeMaps(StackMaps, PyStackMaps, Protocol):
    """The BPF maps the decoder reads: stack walks, Python stacks (bpf/native_stacks.py,
    bpf/py_stacks.py), operator paths."""

    def op_path(self, h: int) -> tuple[int, ...]:
        """The op indices of path hash `h`, outermost first; KeyError when it is not there."""


class VtableNamer(Protocol):
    """Autograd node classes by vtable pointer (bpf/autograd.py VtableNames)."""

    def name(self, vptr: int) -> str | None: ...


class RecordList:
    """Records held apart from the ring (the perf-buffer fallback, a session's queue, the
    pending map, a recording) laid out like the ring (8-byte header each), so
    `RingDecoder.decode` reads them with the same code."""

    def __init__(self, records: list[bytes]):
        buf = bytearray()
        for r in records:
            buf += _RING_HDR.pack(len(r), 0) + r + bytes(-len(r) % 8)
        self.data = memoryview(buf)
        self.mask = (1 << 62) - 1
        self._end = len(buf)

    def positions(self) -> tuple[int, int]:
        return 0, self._end

    def commit(self, pos: int) -> None:
        pass


class RingDecoder:
    """One process's ring records -> Events. `specs`, `op_names` and `vtables` are the attacher's
    (it extends the last two as it finds libraries); `py` is None when Python stacks are not read.

    decode() walks the ring once: one struct unpack per record for its header and event head,
    one more for the arguments of API events; each event is one tuple.__new__ (Event is a tuple
    subclass) and launch/graph/sync arguments stay raw until `Event.args` is read. The consumer
    position is handed back every COMMIT_BYTES, not only at the end, so a long batch does not
    keep the producers from the space already decoded."""

    def __init__(self, pid: int, maps: DecodeMaps, native: AddressNames, *, specs: list[ProbeSpec] = (),
                 py: PyFrames | None = None, py_max_depth: int = PY_MAX_DEPTH, op_names: list[str] | None = None,
                 vtables: VtableNamer | None = None):
        self.pid = pid
        self.maps = maps
        self.native = native
        self.py = py
        self.py_max_depth = py_max_depth
        self._specs = specs
        self._op_names = op_names if op_names is not None else []
        self._vtables = vtables if vtables is not None else autograd.VtableNames()
        self.names: dict[int, str] = {}          # kernel names by handle (name events)
        self.allocs: dict[int, int] = {}         # bytes by pointer, from alloc to free
        self.counts = dict.fromkeys(COUNTS, 0)
        self._unresolved_names: dict[int, str] = {}
        self._shapes: dict[int, tuple] = {}
        self._op_cache: dict[int, tuple[str, ...]] = {0: ()}
        self._undecodable: dict[str, str] = {}   # "what raised" -> where (read_notes)
        self._native_stacks = NativeStacks(maps, native, self.counts)
        self._py_stacks = PyStacks(maps, py, py_max_depth, self.counts, self._note_undecodable)
        self._cfi = self._native_stacks.cfi   # the CFI unwinder, None without one
        # an attribute, not a method: benchmarks/bench_native_stacks.py times it by replacing it
        self._sample_stack = self._native_stacks.sample

    def carry_from(self, earlier: "RingDecoder") -> None:
        """What outlives a detach (a re-attach of the same session): counts, kernel names, live
        allocations and the notes; caches start again."""
        self.counts = self._native_stacks.counts = self._py_stacks.counts = earlier.counts
        self.names = earlier.names
        self.allocs = earlier.allocs
        self._undecodable = earlier._undecodable

    def decode(self, reader, max_events: int, max_s: float = 0.0) -> list[Event]:
        """Walks the ring once (class docstring): at most `max_events` events, `max_s` seconds."""
        deadline = time.monotonic() + max_s if max_s > 0 else 0.0
        out: list[Event] = []
        append = out.append
        rec, args_s = _REC.unpack_from, _ARGS.unpack_from
        data, mask = reader.data, reader.mask
        cons, prod = reader.positions()
        shapes, names, new, me = self._shapes, self.names, _tuple_new, self.pid
        ns, ps = self._native_stacks, self._py_stacks   # each cache, and what fills it on a miss
        stack_cache, stack_miss, sample_stack = ns.by_id, ns.from_map, self._sample_stack
        py_cache, py_miss, op_cache = ps.by_id, ps.symbolized, self._op_cache
        commit_at = cons + COMMIT_BYTES
        while cons < prod:
            off = cons & mask
            (ln, _pg, kind, si, pid, tid, t, dur, oh, _od, sid, pyid, ret, outv, caller, bwd) = rec(data, off)
            if ln & BUSY:
                break
            cons += ((ln & 0x3FFFFFFF) + 15) & ~7
            if cons >= commit_at:
                reader.commit(cons)
                commit_at = cons + COMMIT_BYTES
                if len(out) >= max_events or (deadline and time.monotonic() > deadline):
                    break
            if ln & DISCARD or pid != me:
                continue
            # a record's contents come from the target: one not decodable is counted and dropped
            try:
                if kind == SL_EV_NAME:
                    self._name_event(data, off + 8)
                    continue
                if sid < 0:
                    if sid == SL_STACK_INLINE:     # a CPU sample: its addresses follow the event
                        stack = sample_stack(data, off, ln & 0x3FFFFFFF, outv)
                    else:
                        # -1: not requested; other negatives: the unwind failed (marked, not hidden)
                        stack = () if sid == -1 else TRUNCATED_STACK
                else:
                    stack = stack_cache.get((sid, caller))
                    if stack is None:
                        stack = stack_miss(sid, caller)
                ops = op_cache.get(oh)
                if ops is None:
                    ops = self.op_path(oh)
                pys = py_cache.get(pyid)
                if pys is None:
                    pys = py_miss(pyid)
                if kind == SL_EV_SAMPLE:
                    append(new(Event, ("cpu_sample", "", pid, tid, t, 0, _NO_ARGS, ops, stack, pys[0], "", 0, "", 0,
                                       pys[1], bwd)))
                    continue
                if kind >= SL_EV_NODE_NEW:
                    append(self._node_event(kind, data, off, pid, tid, t, ops, pys))
                    continue
                sh = shapes.get(si)
                if sh is None:
                    sh = shapes[si] = self._shape(si)
                a = args_s(data, off + _ARGS_REC)
                blob = bytes(data[off + _BLOB_REC:off + _BLOB_REC + SL_BLOB]) if sh[5] else b""
                if sh[6]:  # launch / graph / sync / collective: nothing below needs the decoded arguments
                    kernel = ""
                    h = sh[3]
                    if h >= 0:
                        h = a[h]
                        if sh[4]:
                            kernel = self.native.exact_name(h) if h else "unresolved:0x0"
                        else:
                            kernel = names.get(h) or self._unresolved(h)
                    # args: raw (spec, values, blob), decoded by Event.args on access
                    append(new(Event, (sh[1], sh[2], pid, tid, t, dur, (sh[0], a, blob), ops, stack, pys[0], kernel,
                                       0, "", ret, pys[1], bwd)))
                    continue
                append(self._api_event(sh[0], a, blob, pid, tid, t, dur, ops, stack, pys, ret, outv, bwd))
            except Exception as e:  # noqa: BLE001 — see above
                self.counts["records_undecodable"] += 1
                self._note_undecodable("ring record", e)
        reader.commit(cons)
        self.counts["decoded"] += len(out)
        return out

    def _api_event(self, spec: ProbeSpec, a, blob: bytes, pid: int, tid: int, t: int, dur: int, ops, stack, pys,
                   ret: int, outv: int, bwd: int) -> Event:
        """An API call whose arguments are decoded now: alloc, free, memcpy and the rest."""
        k = spec.kind
        args = spec.decode(a, blob)
        nbytes = 0
        direction = ""
        if k == "alloc":
            nbytes = args.get(spec.bytes_arg, 0)
            args["ptr"] = outv
            if ret == 0:
                self.allocs[outv] = nbytes
        elif k == "free":
            nbytes = self.allocs.pop(a[0], 0)
        elif k == "memcpy":
            nbytes = args.get(spec.bytes_arg, 0)
            direction = spec.direction or MEMCPY_KINDS.get(args.get(spec.direction_arg, -1), "unknown")
        return make_event(k, spec.event_name, pid, tid, t, dur, args, ops, stack, pys[0], "", nbytes,
                          direction, ret, pys[1], bwd)

    def _shape(self, si: int) -> tuple:
        """Per probe spec, what the hot loop needs: (spec, kind, symbol, slot of the kernel
        handle or -1, kernel named from a host stub, blob copied, args decoded lazily)."""
        spec = self._specs[si]
        k = spec.kind
        kslot = spec.slots.get(spec.kernel, -1) if k == "launch" and spec.kernel else -1
        return (spec, k, spec.event_name, kslot, spec.kernel_from == "host_stub", bool(spec.struct_fields),
                k in ("launch", "graph", "sync", "collective"))

    def _unresolved(self, h: int) -> str:
        name = self._unresolved_names.get(h)
        if name is None:
            name = f"unresolved:0x{h:x}"
            if len(self._unresolved_names) < 65536:
                self._unresolved_names[h] = name
        return name

    def _name_event(self, data, off: int) -> None:
        _, _, _, _, handle, ref = _NAME_HEAD.unpack_from(data, off)
        raw = bytes(data[off + _NAME_HEAD.size:off + _NAME_HEAD.size + SL_NAME])
        name = raw.split(b"\0", 1)[0].decode("utf-8", "replace")
        if not name and ref:
            name = self.names.get(ref, f"unresolved:0x{ref:x}")
        if handle:
            self.names[handle] = name

    def op_path(self, h: int) -> tuple[str, ...]:
        """The operator names of path hash `h`, outermost first (cached)."""
        path = self._op_cache.get(h)
        if path is not None:
            return path
        try:
            idx = self.maps.op_path(h)
        except KeyError:
            return ("[unknown op path]",)
        names = self._op_names
        path = tuple(names[i] if i < len(names) else f"op#{i}" for i in idx)
        self._op_cache[h] = path
        return path

    def _node_event(self, kind: int, data, off: int, pid: int, tid: int, t: int, ops, pys) -> Event:
        """An autograd node event: its class (from the vtable), sequence number and forward thread."""
        node = _U64.unpack_from(data, off + _ARGS_REC)[0]
        blob = bytes(data[off + _BLOB_REC:off + _BLOB_REC + SL_BLOB])
        vptr, seq, thread, layout = autograd.decode_node(blob, node)
        name = self._vtables.name(vptr) or f"node@0x{vptr:x}"
        args = {"node": node, "seq": seq, "thread": thread, "layout": layout.name}
        if kind == SL_EV_NODE_NEW:
            return make_event("autograd_node", name, pid, tid, t, 0, args, ops, (), pys[0], py_entries=pys[1])
        return make_event("autograd_eval", name, pid, tid, t, 0, args, (), (), ())

    def _note_undecodable(self, what: str, e: Exception) -> None:
        """Keeps, for read_notes(), what raised where (the first few kinds), with the innermost
        frame of the traceback: enough to find the bug without a log."""
        import traceback

        tb = traceback.extract_tb(e.__traceback__)
        at = f" at {os.path.basename(tb[-1].filename)}:{tb[-1].lineno} ({tb[-1].name})" if tb else ""
        key = f"{type(e).__name__}: {e}"[:160]
        if key not in self._undecodable and len(self._undecodable) < UNDECODABLE_KEEP:
            self._undecodable[key] = f"{what}{at}"
            log.warning("pid %d: %s not decodable (counted, the session goes on)", self.pid, what, exc_info=e)

    def read_notes(self) -> list[str]:
        """The profile's notes on what was read from the target and could not be used: bad code
        objects, line tables and strings (counted by pysym, frames marked) and anything that
        raised while decoding (records dropped, stacks marked). [] when all went well."""
        out = self._py_stacks.read_notes()
        u = self.counts
        if u["py_stacks_undecodable"] or u["records_undecodable"]:
            out.append(f"decode errors: {u['py_stacks_undecodable']} python stack(s) marked "
                       f"[python stack undecodable], {u['records_undecodable']} record(s) dropped; "
                       + "; ".join(f"{k} ({where})" for k, where in self._undecodable.items())
                       + " — a stacklens bug, please report it")
        return out

    def py_stats(self) -> dict[str, int]:
        """pysym's counters, as stats() names them; {} without Python stacks (bpf/py_stacks.py)."""
        return self._py_stacks.stats()
