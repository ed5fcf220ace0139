"""The forward→backward link: backward work charged under the forward context that created it.

Pure (no privilege, no I/O); runs on the session's aggregation thread, inside the join.

autograd.bpf.c reports two things (bpf/autograd.py decodes them):
- `autograd_node`: a forward op gave an output its autograd node. The event carries the node's
  address and sequence number, and the Python stack and operator path of the forward thread at
  that moment: the node's *forward context*.
- `autograd_eval`: the engine starts running a node (on an autograd worker thread for CUDA, on
  the thread that called backward() for CPU); launches and CPU samples under it carry the node's
  address (`Event.bwd_node`).
A backward event's path is then

    forward Python frames → forward ops → backward:AddmmBackward0 → backward ops → native → …

DeepContext links nodes to forward ops the same way, through sequence numbers; torch.profiler
shows the same pairs ("Sequence number", "Fwd thread id"). A node is looked up by (address,
sequence number): an address reused by a later node never names the wrong context.

Unlinked nodes are never guessed: a node created before the attach (or whose creation event
was lost) is charged to `backward:NAME` at the root with the evaluating thread's own Python stack
(where backward() was called, or none), and counted; nodes with no forward op (AccumulateGrad,
GraphRoot: sequence number UINT64_MAX) likewise, counted apart.

The caller view (cct/backwardview.py) needs where each linked head was evaluated from: the
evaluating thread's own Python path, which the forward view drops (`note_caller`). One entry
per head, the common path of its callers, CALLERS_MAX heads (least recently noted dropped
first, counted); the snapshot carries it as `meta["backward_callers"]` (`callers_meta`).

Memory: one entry per node created and not yet evaluated — one step's graph — capped at
FORWARD_MAX (oldest dropped first, counted: nodes of graphs that never ran backward, e.g. a
forward with grad enabled and no backward), and the EVALUATED_MAX nodes evaluated last (a
retained graph's second backward); contexts are shared tuples, memoized by the identity of the
stacks the probe session hands out (the same objects for the same stacks).
"""

from __future__ import annotations

import collections
from typing import Any

from stacklens.cct import Frame
from stacklens.cct.backwardview import head_key

FORWARD_MAX = 131_072       # nodes awaiting evaluation (a 48-layer LLM step creates ~20k)
EVALUATED_MAX = 16_384      # nodes evaluated lately: a second backward (retain_graph) finds them
EVALS_PER_THREAD = 64       # nodes being evaluated at once on one thread (reentrant backward)
MEMO_MAX = 65_536
CALLERS_MAX = 65_536        # linked heads whose caller is kept (the caller view)
NO_SEQUENCE = (1 << 64) - 1  # Node(sequence_nr=UINT64_MAX): AccumulateGrad, GraphRoot


class BackwardLink:
    def __init__(self, splice, *, forward_max: int = FORWARD_MAX) -> None:
        self._splice = splice                     # daemon.join.splice
        self._forward_max = forward_max
        self._forward: collections.OrderedDict[tuple[int, int], tuple[Frame, ...]] = collections.OrderedDict()
        self._evaluated: collections.OrderedDict[tuple[int, int], tuple[Frame, ...]] = collections.OrderedDict()
        # thread -> {node: (path head, linked)}
        self._evals: dict[int, collections.OrderedDict[int, tuple[tuple[Frame, ...], bool]]] = {}
        self._contexts: dict[tuple[int, int], tuple] = {}   # (id(py), id(ops)) -> (py, ops, context)
        self._heads: dict[tuple[int, str], tuple[tuple[Frame, ...], tuple[Frame, ...]]] = {}
        # head -> (its key in the snapshot's table, the common path of the callers it was run from)
        self._callers: collections.OrderedDict[tuple[Frame, ...], tuple[str, tuple[Frame, ...]]] = \
            collections.OrderedDict()
        self._caller_paths: dict[tuple[Frame, ...], tuple[Frame, ...]] = {}   # interned: one tuple per path
        self.stats = collections.Counter()

    # ---- events ---------------------------------------------------------------------------
    def on_node(self, ev: Any) -> None:
        a = ev.args
        self.stats["autograd_nodes"] += 1
        fwd = self._forward
        fwd[(a["node"], a["seq"])] = self._context(ev)
        if len(fwd) > self._forward_max:
            fwd.popitem(last=False)
            self.stats["autograd_forward_evicted"] += 1

    def on_eval(self, ev: Any) -> None:
        """The engine runs node `args['node']` on thread `ev.tid`: what that thread launches or
        samples under it gets this head (None: charged as today, from the thread's own stacks,
        under `backward:NAME`)."""
        a = ev.args
        key = (a["node"], a["seq"])
        self.stats["autograd_evals"] += 1
        ctx = self._forward.pop(key, None)
        if ctx is None:
            ctx = self._evaluated.get(key)
        if ctx is None:
            self.stats["autograd_no_forward" if a["seq"] == NO_SEQUENCE else "autograd_unlinked"] += 1
        else:
            self.stats["autograd_linked"] += 1
            done = self._evaluated
            done[key] = ctx
            done.move_to_end(key)
            if len(done) > EVALUATED_MAX:
                done.popitem(last=False)
        evals = self._evals.get(ev.tid)
        if evals is None:
            evals = self._evals[ev.tid] = collections.OrderedDict()
        evals[a["node"]] = (self._head(ctx, ev.api), True) if ctx is not None else ((Frame.backward(ev.api),), False)
        evals.move_to_end(a["node"])
        if len(evals) > EVALS_PER_THREAD:
            evals.popitem(last=False)

    def head(self, tid: int, node: int) -> tuple[tuple[Frame, ...], bool] | None:
        """(path head, linked) for an event of thread `tid` under node `node`; None when the
        node's evaluation was not seen (its event lost: counted)."""
        evals = self._evals.get(tid)
        h = evals.get(node) if evals is not None else None
        if h is None:
            self.stats["autograd_eval_missing"] += 1
        return h

    def note_caller(self, head: tuple[Frame, ...], caller: tuple[Frame, ...]) -> None:
        """A linked head was evaluated on a thread whose own Python path is `caller` (() on a
        thread with no Python: autograd's CUDA workers). Called once per distinct (head, stacks),
        not per event. A second, different caller narrows the entry to the common path."""
        m = self._callers.get(head)
        if m is not None:
            old = m[1]
            if old is not caller and old != caller:
                n = 0
                while n < len(old) and n < len(caller) and old[n] == caller[n]:
                    n += 1
                if n < len(old):
                    self.stats["autograd_caller_mixed"] += 1
                    self._callers[head] = (m[0], self._intern(old[:n]))
            self._callers.move_to_end(head)
            return
        self._callers[head] = (head_key(f.label() for f in head), self._intern(caller))
        if len(self._callers) > CALLERS_MAX:
            self._callers.popitem(last=False)
            self.stats["autograd_caller_evicted"] += 1

    def _intern(self, path: tuple[Frame, ...]) -> tuple[Frame, ...]:
        got = self._caller_paths.get(path)
        if got is None:
            if len(self._caller_paths) >= MEMO_MAX:
                self._caller_paths.clear()
            got = self._caller_paths[path] = path
        return got

    def callers_meta(self) -> dict[str, object]:
        """The caller table as the snapshot carries it (cct/backwardview.py); {} when empty."""
        if not self._callers:
            return {}
        ids: dict[int, int] = {}
        callers: list[list[str]] = []
        heads: dict[str, int] = {}
        for key, caller in self._callers.values():
            i = ids.get(id(caller))
            if i is None:
                i = ids[id(caller)] = len(callers)
                callers.append([f.label() for f in caller])
            heads[key] = i
        return {"callers": callers, "heads": heads}

    # ---- memoized parts -------------------------------------------------------------------
    def _context(self, ev: Any) -> tuple[Frame, ...]:
        py, ops = ev.py_stack, ev.op_path
        key = (id(py), id(ops))
        m = self._contexts.get(key)
        if m is None or m[0] is not py or m[1] is not ops:
            if len(self._contexts) >= MEMO_MAX:
                self._contexts.clear()
            ctx = self._splice(tuple(py), tuple(getattr(ev, "py_entries", ()) or ()), tuple(ops), ())
            m = self._contexts[key] = (py, ops, ctx)   # keeps py and ops alive: ids stay unique
        return m[2]

    def _head(self, ctx: tuple[Frame, ...], name: str) -> tuple[Frame, ...]:
        key = (id(ctx), name)
        m = self._heads.get(key)
        if m is None or m[0] is not ctx:
            if len(self._heads) >= MEMO_MAX:
                self._heads.clear()
            m = self._heads[key] = (ctx, ctx + (Frame.backward(name),))   # keeps ctx alive: its id stays its own
        return m[1]

    def sizes(self) -> dict[str, int]:
        return {"autograd_forward_table": len(self._forward),
                "autograd_eval_threads": len(self._evals)}
