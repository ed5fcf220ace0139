"""PyStacks: the Python stack ids of ring records -> frames, each id symbolized once.

BPF stores each Python stack it reads in `sl_py_stacks` under a content hash of its frames'
code addresses and offsets (pystack.h), so a cached id always names the same stack; an id
evicted from that LRU map before it is read is marked `[python stack lost]`. Frames come from
pystacks/pysym.py (PySymbolizer, behind the `PyFrames` Protocol), which reads the target's code
objects and counts what it could not read; anything else that raises there is marked
`[python stack undecodable]` and told to the decoder. No privilege and no BCC of its own (the
symbolizer reads the target's memory). Overhead: one dict lookup per cached id.
"""

from __future__ import annotations

from typing import Callable, Protocol

from stacklens.cct import Frame

PY_LOST = (Frame.other("[python stack lost]"),)  # id evicted from the LRU map before we read it
PY_UNDECODABLE = (Frame.other("[python stack undecodable]"),)  # the symbolizer raised: a bug, counted
PY_MAX_DEPTH = 48
PY_CACHE_MAX = 65536  # symbolized Python stacks kept by id (ids are content hashes: reusable)


class PyStackMaps(Protocol):
    """The BPF map of Python stacks (bpf/decode.py DecodeMaps has it and more)."""

    def py_stack(self, pyid: int) -> bytes:
        """The raw `struct sl_pystack` of id `pyid`; KeyError when it is not there."""


class PyFrames(Protocol):
    """Raw Python stacks -> frames (pystacks/pysym.py PySymbolizer)."""

    stats: object

    def symbolize(self, raw) -> tuple[Frame, ...]: ...

    def entry_flags(self, raw) -> tuple[bool, ...]: ...


class PyStacks:
    """One process's Python stacks by id -> (frames, entry flags). `by_id` is read first by the
    decoder's hot loop, which calls symbolized() on a miss. `py` is None when Python stacks are
    not read; `counts` is the decoder's dict; `undecodable(what, exception)` is told of a raise."""

    def __init__(self, maps: PyStackMaps, py: PyFrames | None, max_depth: int, counts: dict[str, int],
                 undecodable: Callable[[str, Exception], None]):
        self.maps = maps
        self.py = py
        self.max_depth = max_depth
        self.counts = counts
        self._undecodable = undecodable
        self.by_id: dict[int, tuple[tuple[Frame, ...], tuple[bool, ...]]] = {0: ((), ())}

    def symbolized(self, pyid: int) -> tuple[tuple[Frame, ...], tuple[bool, ...]]:
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
        raw = RawPyStack.from_bytes(leaf, self.max_depth)
        try:
            frames = py.symbolize(raw)
        except Exception as e:  # noqa: BLE001 — pysym counts and marks every bad object it knows;
            # anything else is a bug there, and still not the end of the session: marked, not cached
            self.counts["py_stacks_undecodable"] += 1
            self._undecodable("python stack", e)
            return PY_UNDECODABLE, (False,)
        entries = py.entry_flags(raw)
        if raw.truncated:
            entries = (False,) + entries  # the leading [truncated] marker
        if len(self.by_id) >= PY_CACHE_MAX:
            self.by_id.clear()
            self.by_id[0] = ((), ())
        v = (frames, entries)
        self.by_id[pyid] = v
        self.counts["py_stacks_symbolized"] += 1
        return v

    def read_notes(self) -> list[str]:
        """The note on Python frames read from freed or changing objects (counted by pysym,
        frames marked); [] when there were none or Python stacks are not read."""
        if self.py is None:
            return []
        st = self.py.stats
        parts = [f"{n} {what}" for n, what in (
            (st.errors, "frame(s) without a readable code object [unreadable code object]"),
            (st.bad_strings, "code object name(s) not a str [unreadable code object name]"),
            (st.bad_linetables, "line table(s) not decodable (the frame shows the function's first line)"))
            if n]
        if not parts:
            return []
        return ["python frames read from freed or changing objects: " + ", ".join(parts) + "; the session goes on"]

    def stats(self) -> dict[str, int]:
        """pysym's counters, as the session's stats() names them; {} without Python stacks."""
        if self.py is None:
            return {}
        st = self.py.stats
        return dict(py_code_hits=st.hits, py_code_misses=st.misses, py_code_stale=st.stale,
                    py_code_errors=st.errors, py_bad_linetables=st.bad_linetables,
                    py_bad_strings=st.bad_strings)
