"""NativeStacks: the native stacks of ring records -> frames, each distinct stack symbolized once.

Three sources (bpf/programs/stacklens.h, cpu.bpf.c): a BPF stack-map walk by id (API and op
events; the direct caller, which a walk at function entry skips, is added back), the
frame-pointer walk a CPU sample carries after its event, and, where the sample also carries its
registers and a stack copy, a walk of those with the libraries' .eh_frame (bpf/unwind.py
CfiUnwinder), kept unless the frame-pointer walk is longer. `native_frames` is the rule that turns
a walk into frames and says whether it was cut.

No privilege and no BCC: the maps and the symbolizer come in behind Protocols (`StackMaps`,
`AddressNames`), so it runs on fakes and recorded rings. Overhead: one dict lookup per cached
stack; a CFI walk 33-59 µs of CPU per sample offline, ~160 µs live on a loaded VM
(docs/benchmarks/native-stacks.md).
"""

from __future__ import annotations

import ctypes as ct
import struct
from typing import Iterable, Protocol

from stacklens.cct import Frame
from stacklens.bpf.events_abi import SL_STACK_IN_2, SlEvent
from stacklens.bpf.procmaps import UNKNOWN as UNKNOWN_FRAME
from stacklens.bpf.procmaps import collapse_unsymbolized, is_unsymbolized

EVENT_SIZE = ct.sizeof(SlEvent)
TRUNCATED = Frame.other("[truncated]")
STACK_DEPTH = 127  # frames a BPF stack-map walk holds (perf_event_max_stack): a full walk may be cut
INLINE_CACHE_MAX = 4096  # CPU samples' stacks kept by their addresses (≤ ~5 MiB; then it starts again)
TRUNCATED_STACK = (TRUNCATED,)
# outermost frames of a complete user stack; anything else at the bottom means the unwind was cut
_STACK_ROOTS = ("_start", "__libc_start_main", "__libc_start_call_main", "clone", "clone3",
                "__clone", "__clone3", "start_thread", "__GI___clone3", "__GI___clone")
_CFI_OFF = EVENT_SIZE + 8 * STACK_DEPTH   # a CPU sample's registers and stack copy (cpu.bpf.c) start here


class StackMaps(Protocol):
    """The BPF stack maps (bpf/decode.py DecodeMaps has these and more)."""

    def walk_stack(self, table: bytes, key: int) -> Iterable[int]:
        """Innermost-first addresses of stack `key` in `table` (b"stacks" or b"stacks2")."""


class AddressNames(Protocol):
    """Native addresses -> frames and names (bpf/procmaps.py NativeSymbolizer)."""

    def frame(self, addr: int) -> Frame: ...

    def exact_name(self, addr: int) -> str: ...


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


class NativeStacks:
    """One process's native stacks -> frames. `by_id` holds the stack-map walks by (stack id,
    direct caller): the decoder's hot loop looks there first and calls from_map() on a miss.
    Cut walks and failed lookups are counted in `counts` (the decoder's dict)."""

    def __init__(self, maps: StackMaps, native: AddressNames, counts: dict[str, int]):
        self.maps = maps
        self.native = native
        self.counts = counts
        self.by_id: dict[tuple[int, int], tuple[Frame, ...]] = {}
        self._inline_cache: dict[bytes, tuple[Frame, ...]] = {}   # CPU samples' stacks by address bytes
        self._cfi_cache: dict[tuple[int, ...], tuple[Frame, ...]] = {}  # CFI walks' callers by their addresses
        # CPU samples that carry their registers and stack are walked with .eh_frame (bpf/unwind.py)
        self.cfi = None
        if hasattr(native, "mapping") and hasattr(native, "host_path"):
            from stacklens.bpf.unwind import MAX_FRAMES, REGS_BYTES, CfiUnwinder
            self.cfi = CfiUnwinder(native.mapping, native.host_path, getattr(native, "known_mapping", None))
            self._cfi_regs_bytes, self._cfi_max_frames = REGS_BYTES, MAX_FRAMES

    def sample(self, data, off: int, rl: int, n: int) -> tuple[Frame, ...]:
        """A CPU sample's native stack: walked with CFI from its registers and stack copy where
        the record has one, else from the `n` addresses of its frame-pointer walk after its event.
        The frame-pointer walk is read only where the CFI walk was cut (the longer one is kept):
        it breaks in code without frame pointers and names the garbage it read there, and a
        garbage address outside every mapping costs the symbolizer a read of the maps."""
        if rl > _CFI_OFF and self.cfi is not None:
            frames = self._cfi_stack(data, off, rl)
            if frames is not None and frames[0] is not TRUNCATED:
                return frames
            fp = self._inline_stack(data, off, min(n, rl - EVENT_SIZE))
            return fp if frames is None or len(fp) > len(frames) else frames
        return self._inline_stack(data, off, min(n, rl - EVENT_SIZE))

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
        addrs, complete = self.cfi.unwind(data[start:start + regs_bytes], data[start + regs_bytes:end])
        self.cfi.counts["unwinds"] += 1
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
            self.cfi.counts["complete"] += 1
        return frames

    def from_map(self, sid: int, caller: int = 0) -> tuple[Frame, ...]:
        """Stack `sid` of the stack maps (with `caller`, the direct caller, added), cached in by_id."""
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
        self.by_id[(sid, caller)] = frames
        return frames
