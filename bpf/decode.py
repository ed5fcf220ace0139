"""RingDecoder: the bytes of ring records -> `Event`s with symbolized native and Python frames.

No privilege and no BCC: everything it reads from outside the records comes in through its
constructor behind narrow Protocols (`DecodeMaps` for the BPF maps, the native and Python
symbolizers, which read the target through `ProcessMemory` and `ProcFS`), so it runs on fakes in
tests/unit and on recorded rings in tests/replay. Overhead: one struct unpack per record and
cached stacks, op paths and Python stacks: 2.5-4.5 µs of CPU per event on the busy 2-vCPU VM
(`benchmarks/bench_decode.py --rings 1500`).
"""

from __future__ import annotations

import ctypes as ct
import logging
import os
import struct
import time
from typing import Iterable, Protocol

from stacklens.cct import Frame
from stacklens.bpf import autograd
from stacklens.bpf.events_abi import (SL_BLOB, SL_EV_NAME, SL_EV_NODE_NEW, SL_EV_SAMPLE, SL_NAME, SL_NARGS,
                                      SL_STACK_IN_2, SL_STACK_INLINE, SlEvent)
from stacklens.bpf.procmaps import UNKNOWN as UNKNOWN_FRAME
from stacklens.bpf.procmaps import collapse_unsymbolized, is_unsymbolized
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
EVENT_SIZE = ct.sizeof(SlEvent)
_RING_HDR = struct.Struct("<II")
_tuple_new = tuple.__new__  # Event is a tuple subclass (records/events.py)
_NO_ARGS: dict = {}  # shared by every sample (Event.args is read-only by contract)
_U64 = struct.Struct("<Q")
TRUNCATED = Frame.other("[truncated]")
STACK_DEPTH = 127  # frames a BPF stack-map walk holds (perf_event_max_stack): a full walk may be cut
INLINE_CACHE_MAX = 4096  # CPU samples' stacks kept by their addresses (≤ ~5 MiB; then it starts again)
TRUNCATED_STACK = (TRUNCATED,)
PY_LOST = (Frame.other("[python stack lost]"),)  # id evicted from the LRU map before we read it
PY_UNDECODABLE = (Frame.other("[python stack undecodable]"),)  # the symbolizer raised: a bug, counted
UNDECODABLE_KEEP = 4  # distinct "what raised" texts kept for the notes (the first ones)
PY_MAX_DEPTH = 48
PY_CACHE_MAX = 65536  # symbolized Python stacks kept by id (ids are content hashes: reusable)
# outermost frames of a complete user stack; anything else at the bottom means the unwind was cut
_STACK_ROOTS = ("_start", "__libc_start_main", "__libc_start_call_main", "clone", "clone3",
                "__clone", "__clone3", "start_thread", "__GI___clone3", "__GI___clone")
_CFI_OFF = EVENT_SIZE + 8 * STACK_DEPTH   # a CPU sample's registers and stack copy (cpu.bpf.c) start here
COUNTS = ("decoded", "truncated_stacks", "stack_lookup_failures", "py_stacks_symbolized", "py_stacks_lost",
          "py_stacks_undecodable", "records_undecodable")


class DecodeMaps(Protocol):
    """The BPF maps the decoder reads: stack walks, operator paths, Python stacks."""

    def walk_stack(self, table: bytes, key: int) -> Iterable[int]:
        """Innermost-first addresses of stack `key` in `table` (b"stacks" or b"stacks2")."""

    def op_path(self, h: int) -> tuple[int, ...]:
        """The op indices of path hash `h`, outermost first; KeyError when it is not there."""

    def py_stack(self, pyid: int) -> bytes:
        """The raw `struct sl_pystack` of id `pyid`; KeyError when it is not there."""


class AddressNames(Protocol):
    """Native addresses -> frames and names (bpf/procmaps.py NativeSymbolizer)."""

    def frame(self, addr: int) -> Frame: ...

    def exact_name(self, addr: int) -> str: ...


class PyFrames(Protocol):
    """Raw Python stacks -> frames (pystacks/pysym.py PySymbolizer)."""

    stats: object

    def symbolize(self, raw) -> tuple[Frame, ...]: ...

    def entry_flags(self, raw) -> tuple[bool, ...]: ...


class VtableNamer(Protocol):
    """Autograd node classes by vtable pointer (bpf/autograd.py VtableNames)."""

    def name(self, vptr: int) -> str | None: ...


def native_frames(addrs: list[int], frame, walked: int | None = None) -> tuple[tuple[Frame, ...], bool]:
    """A frame-pointer walk (innermost-first addresses, as BPF returns them) -> outermost-first
    frames, and whether the walk was cut: it ends at the first address outside every
    executable mapping (`[unknown]`: the walk read garbage there, e.g. a caller that does not keep
    frame pointers), at the map's depth limit, or anywhere but a thread's entry (_start,
    start_thread, clone): then a `[truncated]` frame leads. JIT code (`[anon]`) and the vDSO
    are real frames of the stack and do not end it. Runs of unsymbolized frames of one library
    collapse into one. `walked`: how many addresses the walk itself gave (default all of them;
    fewer when the direct caller was added to them)."""
    inner: list[Frame] = []
    cut = (len(addrs) if walked is None else walked) >= STACK_DEPTH
    for a in addrs:
        f = frame(a)
        if f == UNKNOWN_FRAME:
            cut = True
            break
        inner.append(f)
    frames = collapse_unsymbolized(reversed(inner))
    root = frames[0].name if frames else ""
    if cut or not any(root == r or root.startswith(r + "@") for r in _STACK_ROOTS):
        return (TRUNCATED,) + frames, True
    return frames, False


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
        self._stack_cache: dict[tuple[int, int], tuple[Frame, ...]] = {}
        self._inline_cache: dict[bytes, tuple[Frame, ...]] = {}   # CPU samples' stacks by address bytes
        self._cfi_cache: dict[tuple[int, ...], tuple[Frame, ...]] = {}  # CFI walks' callers by their addresses
        self._py_cache: dict[int, tuple[tuple[Frame, ...], tuple[bool, ...]]] = {0: ((), ())}
        self._op_cache: dict[int, tuple[str, ...]] = {0: ()}
        self._undecodable: dict[str, str] = {}   # "what raised" -> where (read_notes)
        # CPU samples that carry their registers and stack are walked with .eh_frame (bpf/unwind.py)
        self._cfi = None
        if hasattr(native, "mapping") and hasattr(native, "host_path"):
            from stacklens.bpf.unwind import MAX_FRAMES, REGS_BYTES, CfiUnwinder
            self._cfi = CfiUnwinder(native.mapping, native.host_path, getattr(native, "known_mapping", None))
            self._cfi_regs_bytes, self._cfi_max_frames = REGS_BYTES, MAX_FRAMES

    def carry_from(self, earlier: "RingDecoder") -> None:
        """What outlives a detach (a re-attach of the same session): counts, kernel names, live
        allocations and the notes; caches start again."""
        self.counts = earlier.counts
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
        shapes = self._shapes
        stack_cache, op_cache, py_cache = self._stack_cache, self._op_cache, self._py_cache
        names = self.names
        new = _tuple_new
        me = self.pid
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
                        stack = self._sample_stack(data, off, ln & 0x3FFFFFFF, outv)
                    else:
                        # -1: not requested; other negatives: the unwind failed (marked, not hidden)
                        stack = () if sid == -1 else TRUNCATED_STACK
                else:
                    stack = stack_cache.get((sid, caller))
                    if stack is None:
                        stack = self._stack(sid, caller)
                ops = op_cache.get(oh)
                if ops is None:
                    ops = self.op_path(oh)
                pys = py_cache.get(pyid)
                if pys is None:
                    pys = self._py_stack(pyid)
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

    def _sample_stack(self, data, off: int, rl: int, n: int) -> tuple[Frame, ...]:
        """A CPU sample's native stack: walked with CFI from its registers and stack copy where
        the record has one, else from the `n` addresses of its frame-pointer walk after its event.
        The frame-pointer walk is read only where the CFI walk was cut (the longer one is kept):
        it breaks in code without frame pointers and names the garbage it read there, and a
        garbage address outside every mapping costs the symbolizer a read of the maps."""
        if rl > _CFI_OFF and self._cfi is not None:
            frames = self._cfi_stack(data, off, rl)
            if frames is not None and frames[0] is not TRUNCATED:
                return frames
            fp = self._inline_stack(data, off, min(n, rl - EVENT_SIZE))
            return fp if frames is None or len(fp) > len(frames) else frames
        return self._inline_stack(data, off, min(n, rl - EVENT_SIZE))

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

    def _inline_stack(self, data, off: int, nbytes: int) -> tuple[Frame, ...]:
        """The addresses a CPU sample carries after its event (innermost first), as frames;
        cached by the addresses themselves."""
        n = max(0, min(nbytes, STACK_DEPTH * 8)) // 8
        start = off + 8 + EVENT_SIZE
        key = bytes(data[start:start + 8 * n])          # compact: at most 1 KiB a key
        frames = self._inline_cache.get(key)
        if frames is None:
            frames, cut = native_frames(list(struct.unpack(f"<{n}Q", key)), self.native.frame)
            if cut:
                self.counts["truncated_stacks"] += 1
            if len(self._inline_cache) >= INLINE_CACHE_MAX:
                self._inline_cache.clear()
            self._inline_cache[key] = frames
        return frames

    def _cfi_stack(self, data, off: int, rl: int) -> tuple[Frame, ...] | None:
        """A CPU sample walked with the libraries' CFI from its registers and stack copy (None:
        the record is too short to hold the registers)."""
        start = off + 8 + _CFI_OFF
        end = off + 8 + rl
        regs_bytes = self._cfi_regs_bytes
        if end - start < regs_bytes:
            return None
        addrs, complete = self._cfi.unwind(data[start:start + regs_bytes], data[start + regs_bytes:end])
        self._cfi.counts["unwinds"] += 1
        frame = self.native.frame
        walked = STACK_DEPTH if len(addrs) >= self._cfi_max_frames else 0
        leaf = frame(addrs[0])
        if len(addrs) == 1 or leaf == UNKNOWN_FRAME:
            frames = native_frames(addrs, frame, walked)[0]
        else:
            # the leaf is any instruction, its callers' return addresses repeat: the callers'
            # frames are cached by their addresses, the leaf's frame goes below them
            key = tuple(addrs[1:])
            callers = self._cfi_cache.get(key)
            if callers is None:
                callers = native_frames(addrs[1:], frame, walked)[0]
                if len(self._cfi_cache) >= INLINE_CACHE_MAX:
                    self._cfi_cache.clear()
                self._cfi_cache[key] = callers
            frames = callers if callers[-1] == leaf and is_unsymbolized(leaf) else callers + (leaf,)
        if frames[0] is not TRUNCATED:
            self._cfi.counts["complete"] += 1
        return frames

    def _stack(self, sid: int, caller: int = 0) -> tuple[Frame, ...]:
        table, key = (b"stacks2", sid & ~SL_STACK_IN_2) if sid & SL_STACK_IN_2 else (b"stacks", sid)
        try:
            addrs = list(self.maps.walk_stack(table, key))
        except Exception:
            addrs = []
        walked = len(addrs)
        if caller and addrs and (len(addrs) < 2 or addrs[1] != caller):
            addrs.insert(1, caller)  # the direct caller, skipped by the walk at function entry
        if not addrs:
            self.counts["stack_lookup_failures"] += 1
            frames: tuple[Frame, ...] = (TRUNCATED,)
        else:
            frames, cut = native_frames(addrs, self.native.frame, walked)
            if cut:
                self.counts["truncated_stacks"] += 1
        self._stack_cache[(sid, caller)] = frames
        return frames

    def _py_stack(self, pyid: int) -> tuple[tuple[Frame, ...], tuple[bool, ...]]:
        """Python stack `pyid` from `sl_py_stacks`, symbolized once per id (ids hash the frames'
        code addresses and offsets, so a cached id always names the same stack)."""
        from stacklens.pystacks.pysym import RawPyStack

        py = self.py
        if py is None:
            return (), ()
        try:
            leaf = self.maps.py_stack(pyid)
        except KeyError:
            # LRU-evicted between the probe and this read: marked, not cached (it may come back)
            self.counts["py_stacks_lost"] += 1
            return PY_LOST, (False,)
        raw = RawPyStack.from_bytes(leaf, self.py_max_depth)
        try:
            frames = py.symbolize(raw)
        except Exception as e:  # noqa: BLE001 — pysym counts and marks every bad object it knows;
            # anything else is a bug there, and still not the end of the session: marked, not cached
            self.counts["py_stacks_undecodable"] += 1
            self._note_undecodable("python stack", e)
            return PY_UNDECODABLE, (False,)
        entries = py.entry_flags(raw)
        if raw.truncated:
            entries = (False,) + entries  # the leading [truncated] marker
        if len(self._py_cache) >= PY_CACHE_MAX:
            self._py_cache.clear()
            self._py_cache[0] = ((), ())
        v = (frames, entries)
        self._py_cache[pyid] = v
        self.counts["py_stacks_symbolized"] += 1
        return v

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
        out = []
        if self.py is not None:
            st = self.py.stats
            parts = [f"{n} {what}" for n, what in (
                (st.errors, "frame(s) without a readable code object [unreadable code object]"),
                (st.bad_strings, "code object name(s) not a str [unreadable code object name]"),
                (st.bad_linetables, "line table(s) not decodable (the frame shows the function's first line)"))
                if n]
            if parts:
                out.append("python frames read from freed or changing objects: " + ", ".join(parts)
                           + "; the session goes on")
        u = self.counts
        if u["py_stacks_undecodable"] or u["records_undecodable"]:
            out.append(f"decode errors: {u['py_stacks_undecodable']} python stack(s) marked "
                       f"[python stack undecodable], {u['records_undecodable']} record(s) dropped; "
                       + "; ".join(f"{k} ({where})" for k, where in self._undecodable.items())
                       + " — a stacklens bug, please report it")
        return out

    def py_stats(self) -> dict[str, int]:
        """pysym's counters, as stats() names them; {} without Python stacks."""
        if self.py is None:
            return {}
        st = self.py.stats
        return dict(py_code_hits=st.hits, py_code_misses=st.misses, py_code_stale=st.stale,
                    py_code_errors=st.errors, py_bad_linetables=st.bad_linetables,
                    py_bad_strings=st.bad_strings)
