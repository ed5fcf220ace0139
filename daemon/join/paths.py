"""The path of a BPF event: its stacks spliced into one path, memoized by the stacks' identity.

Pure (no privilege, no I/O); runs on the process's aggregation thread, inside the `Joiner`.

An event's path is its Python, operator and native stacks spliced (daemon/join/splice.py), rewritten
through torch.compile's module map once the agent sent it (`InductorIndex`, daemon/join/compiled.py),
and, for work under an autograd node, put under that node's forward context (`BackwardLink`,
daemon/join/backward.py). A launch's path adds `api:…` and `kernel:…` below that.

Cost: the probe session hands out the same tuples for the same stack ids, so an event's path is
memoized on the identity of its stack tuples (the memo entry keeps them alive, so their ids stay
unique), and a launch's path on (that entry, api, kernel name): most events are one dict lookup,
and the same launch path is the same tuple object, which `WindowedCCT.stage` relies on.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from stacklens.cct import Frame
from stacklens.daemon.join.backward import BackwardLink
from stacklens.daemon.join.compiled import InductorIndex
from stacklens.daemon.join.gpujoin import Path
from stacklens.daemon.join.splice import sample_frames, splice
from stacklens.records.agent import InductorRecord, SampleFrame

if TYPE_CHECKING:
    from stacklens.records.events import Event

MEMO_MAX = 65_536          # memo entries of each kind; cleared, not evicted, when full
LAUNCHES_PER_API = 4096    # kernel names memoized per (path, api)


class _Entry:
    """A memoized base path: the stacks it was spliced from (kept alive, so their ids stay
    unique), the spliced path, and the launch paths below it ({api: {kernel name: path}}).
    A backward entry is keyed by the node's head too, and its own Python frames (`py`)."""
    __slots__ = ("py", "nat", "ops", "path", "launches", "head")

    def __init__(self, py: tuple, nat: tuple, ops: tuple, path: Path, head: Path | None = None) -> None:
        self.py, self.nat, self.ops, self.path, self.head = py, nat, ops, path, head
        self.launches: dict[str, dict[str, Path]] = {}


class EventPaths:
    """Paths of one process's events. `backward` gives the heads of autograd nodes;
    `handle_names` ("unresolved:0x…" → kernel name, learnt from CUPTI by `GpuCharges`) names a
    launch's kernel frame once its handle's name is known."""

    def __init__(self, backward: BackwardLink, handle_names: dict[str, str]) -> None:
        self.backward = backward
        self.handle_names = handle_names
        self.compiled: InductorIndex | None = None   # once the agent sends torch.compile's modules
        self._splice_memo: dict[tuple[int, int, int], _Entry] = {}
        self._backward_memo: dict[tuple[int, int, int, int], _Entry] = {}

    def launch(self, ev: Event) -> Path:
        """base + api:… (+ kernel:…) of a kernel or graph launch: the same tuple for the same
        stacks, api and kernel name (the base entry's lookup inline: one per launch)."""
        py, nat, ops = ev.py_stack, ev.native_stack, ev.op_path
        if getattr(ev, "bwd_node", 0):
            m = self.base(ev)
        else:
            key = (id(py), id(nat), id(ops))
            m = self._splice_memo.get(key)
            if m is None or m.py is not py or m.nat is not nat or m.ops is not ops:
                m = self._new_base_entry(ev, key)
        name = getattr(ev, "kernel_name", "") or ""
        if name.startswith("unresolved:"):  # CUPTI named this handle before: use the name
            name = self.handle_names.get(name, name)
        api = ev.api
        by_name = m.launches.get(api)
        path = None if by_name is None else by_name.get(name)
        if path is None:
            path = self._suffixed(m, api, name)
        return path

    @staticmethod
    def _suffixed(m: _Entry, api: str, name: str) -> Path:
        """base + api:… (+ kernel:…), built once per (base, api, name): the same tuple after."""
        by_name = m.launches.setdefault(api, {})
        path = m.path + (Frame.api(api), Frame.kernel(name)) if name else m.path + (Frame.api(api),)
        if len(by_name) >= LAUNCHES_PER_API:
            by_name.clear()
        by_name[name] = path
        return path

    def context_of(self, ev: Event) -> Path:
        """The path an event of this kind would be charged under, charging nothing."""
        return self.base(ev).path + (Frame.api(ev.api),)

    def sample(self, frames: tuple[SampleFrame, ...]) -> Path:
        """The path of one of the agent's Python samples (outermost first)."""
        path = sample_frames(frames)
        if self.compiled is not None:
            path = self.compiled.rewrite(path)
        return path

    def add_inductor(self, rec: InductorRecord) -> bool:
        """A part of a torch.compile wrapper module's map (the index made at the first); True
        once a map is complete: paths spliced before are spliced again (the memos cleared) so
        they go through it."""
        if self.compiled is None:
            self.compiled = InductorIndex()
        if not self.compiled.add(rec):
            return False
        self._splice_memo.clear()
        self._backward_memo.clear()
        return True

    def base(self, ev: Event) -> _Entry:
        """The memo entry of the event's stacks (`_Entry`: their splice() and launch paths),
        memoized on the identity of its parts. An event under an autograd node (`bwd_node`)
        gets the node's head (daemon/join/backward.py) in place of its Python frames."""
        py, nat, ops = ev.py_stack, ev.native_stack, ev.op_path
        node = getattr(ev, "bwd_node", 0)
        if node:
            h = self.backward.head(ev.tid, node)
            if h is not None:
                return self._backward_entry(ev, *h)
        key = (id(py), id(nat), id(ops))
        m = self._splice_memo.get(key)
        if m is not None and m.py is py and m.nat is nat and m.ops is ops:
            return m
        return self._new_base_entry(ev, key)

    def _backward_entry(self, ev: Event, head: Path, linked: bool) -> _Entry:
        """The memo entry of a backward event: head (forward context → backward:NODE) + the
        node's own operators and native frames below the engine's evaluate_function. An
        unlinked node's head follows the thread's own Python frames (where backward() ran)."""
        py, nat, ops = ev.py_stack, ev.native_stack, ev.op_path
        # keyed by the thread's own Python stack even where the path drops it: the caller view's table
        key = (id(head), id(py), id(nat), id(ops))
        m = self._backward_memo.get(key)
        if m is not None and m.head is head and m.nat is nat and m.ops is ops and m.py is py:
            return m
        # a compiled backward's wrapper line: its model lines follow the head (daemon/join/compiled.py)
        tail = self.compiled.tail(py) if linked and self.compiled is not None else None
        own = splice(tuple(py), tuple(getattr(ev, "py_entries", ()) or ()), (), ()) if py and tail is None else ()
        if own and self.compiled is not None:
            own = self.compiled.rewrite(own)
        if linked:
            if tail is None:
                self.backward.note_caller(head, own)   # where backward() ran: the caller view
            own = ()
        native = tuple(nat)
        below = next((i for i in range(len(native) - 1, -1, -1) if "evaluate_function" in native[i].name), -1)
        path = own + head + (tail or ()) + splice((), (), tuple(ops), native[below + 1:] if below >= 0 else native)
        if len(self._backward_memo) >= MEMO_MAX:
            self._backward_memo.clear()
        m = self._backward_memo[key] = _Entry(py, nat, ops, path, head)
        return m

    def _new_base_entry(self, ev: Event, key: tuple[int, int, int]) -> _Entry:
        """A memo miss: splice the event's stacks and remember them under `key` (their ids)."""
        py, nat, ops = ev.py_stack, ev.native_stack, ev.op_path
        path = splice(tuple(py), tuple(getattr(ev, "py_entries", ()) or ()), tuple(ops), tuple(nat))
        if self.compiled is not None:
            path = self.compiled.rewrite(path)
        if len(self._splice_memo) >= MEMO_MAX:
            self._splice_memo.clear()
        m = self._splice_memo[key] = _Entry(py, nat, ops, path)  # keeps the parts alive: ids stay unique
        return m
