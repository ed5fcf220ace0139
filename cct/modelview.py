"""The model view: a snapshot with framework plumbing collapsed and module calls named.

Pure, no privilege, no I/O; O(nodes) with one rule match per distinct frame. A torch training
path is 30+ frames of `Module._wrapped_call_impl` / `_call_impl`, decorator wrappers and dynamo
frames before the first operator; here those frames go (their children merge into the caller,
their own values with them, so every total stays exact) and each module call becomes one
`module` frame, `transformer.h.3.attn · GPT2Attention`, as torch.profiler's module hierarchy
names them:

- a `module` frame from the agent (its sampler reads the instance: class and attribute path) is
  kept, and the `forward` frame under it merges into it;
- a `forward` reached through a module call wrapper (the BPF walker sees code only) becomes
  `module("", CLASS)`, CLASS from the code's qualname (the class that defines `forward`).

A module's forward lines merge into its one node: the model view is per module, the full view
(the snapshot as it was) keeps the lines. What counts as plumbing is the data in `PLUMBING`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from fnmatch import fnmatchcase

from stacklens.cct.frames import Frame, python_module_of
from stacklens.cct.snapshot import Snapshot

MODEL, FULL = "model", "full"
VIEWS = (MODEL, FULL)


@dataclass(frozen=True, slots=True)
class Rule:
    module: str             # dotted module of the frame's file, fnmatch pattern
    qualname: str           # regular expression, matched in full
    why: str
    calls_module: bool = False   # the wrapper calls a module's forward: it names the next forward

    def matches(self, module: str, qualname: str) -> bool:
        return fnmatchcase(module, self.module) and re.fullmatch(self.qualname, qualname) is not None


_ANY = ".*"
_LOCAL_WRAPPER = r".*<locals>\..*"   # a closure a decorator returns (`can_return_tuple.<locals>.wrapper`)

PLUMBING: tuple[Rule, ...] = (
    Rule("torch.nn.modules.module", r"Module\.(_wrapped_call_impl|_call_impl|__call__)(\.<locals>\..*)?",
         "module call wrapper", calls_module=True),
    Rule("torch.nn.modules.module", r"Module\.__getattr__", "submodule and parameter lookup"),
    Rule("transformers.modeling_layers", _LOCAL_WRAPPER + "|GradientCheckpointingLayer\\.__call__",
         "transformers' checkpointing layer call", calls_module=True),
    Rule("transformers.utils.*", _LOCAL_WRAPPER, "transformers decorator (can_return_tuple, deprecate_kwarg …)"),
    Rule("functools", _ANY, "functools wrapper (wraps, singledispatch, partialmethod)"),
    Rule("contextlib", _ANY, "contextmanager / ContextDecorator"),
    Rule("torch.utils._contextlib", _ANY, "no_grad / inference_mode decorator"),
    Rule("torch._dynamo.eval_frame", _ANY, "dynamo entry / disable wrapper"),
    Rule("torch._dynamo.external_utils", _ANY, "dynamo wrapper"),
    Rule("torch._compile", _ANY, "torch._disable_dynamo wrapper"),
    Rule("torch._ops", r".*\.__call__", "operator overload dispatch"),
    Rule("torch.autograd.profiler", r"record_function\..*", "record_function scope"),
    Rule("torch._tensor", r"Tensor\.backward|" + _LOCAL_WRAPPER, "Tensor method wrapper"),
    Rule("torch.autograd", r"backward", "autograd entry"),
    Rule("torch.autograd.graph", r"_engine_run_backward", "autograd engine entry"),
    Rule("torch.optim.optimizer", _LOCAL_WRAPPER, "optimizer step hooks and no-grad wrapper"),
)

_KEEP, _COLLAPSE, _MODULE_FORWARD = 0, 1, 2


def _classify(frame: Frame, rules: tuple[Rule, ...]) -> tuple[int, Rule | None]:
    if frame.kind != "python":
        return _KEEP, None
    module = python_module_of(frame.file)
    for rule in rules:
        if rule.matches(module, frame.name):
            return _COLLAPSE, rule
    if frame.name.endswith(".forward"):
        return _MODULE_FORWARD, None
    return _KEEP, None


def class_of_forward(qualname: str) -> str:
    """`GPT2Attention` of `GPT2Attention.forward` (`Outer.<locals>.Inner.forward`: `Inner`)."""
    return qualname.removesuffix(".forward").rpartition(".")[2]


def module_text(frame: Frame) -> str:
    """How views show a module frame: `transformer.h.3.attn · GPT2Attention`, the class alone
    for the outermost module or where the path is not known."""
    return f"{frame.name} · {frame.file}" if frame.name else frame.file


def has_model(snap: Snapshot, rules: tuple[Rule, ...] = PLUMBING) -> bool:
    """Whether the profile has module calls (what the model view is for)."""
    calls = [r for r in rules if r.calls_module]
    for frame in {snap.frame_of(n) for n in range(1, snap.node_count)}:
        if frame.kind == "module":
            return True
        if frame.kind == "python" and any(r.matches(python_module_of(frame.file), frame.name) for r in calls):
            return True
    return False


def model_view(snap: Snapshot, rules: tuple[Rule, ...] = PLUMBING) -> Snapshot:
    """`snap` with the frames `rules` match collapsed into their callers and module calls named
    (see the module docstring); `meta["view"]` says "model" and how many frames went."""
    if snap.meta.get("view") == MODEL:
        return snap
    memo: dict[Frame, tuple[int, Rule | None]] = {}
    frames: list[Frame] = [snap.frame_of(0)]
    parents: list[int] = [-1]
    index: dict[tuple[int, Frame], int] = {}
    out_of = [0] * snap.node_count
    # per node: it was collapsed on the way from a module call wrapper to the callee (a decorator
    # between `_call_impl` and `forward` keeps it), or it is an agent's module frame
    pending_call = [False] * snap.node_count
    collapsed = 0
    for node in range(1, snap.node_count):
        frame = snap.frame_of(node)
        parent = snap.parent(node)
        parent_out = out_of[parent]
        if frame.kind == "module":
            pending_call[node] = True
        else:
            action, rule = memo.get(frame) or memo.setdefault(frame, _classify(frame, rules))
            if action == _COLLAPSE:
                out_of[node] = parent_out
                pending_call[node] = rule.calls_module or pending_call[parent]
                collapsed += 1
                continue
            if action == _MODULE_FORWARD and pending_call[parent]:
                if snap.frame_of(parent).kind == "module":
                    out_of[node] = parent_out     # the agent named this call already
                    collapsed += 1
                    continue
                frame = Frame.module("", class_of_forward(frame.name))
        key = (parent_out, frame)
        out = index.get(key)
        if out is None:
            out = index[key] = len(frames)
            frames.append(frame)
            parents.append(parent_out)
        out_of[node] = out
    exclusive = {}
    for m in snap.metrics:
        col = [0] * len(frames)
        for node in range(snap.node_count):
            value = snap.exclusive(node, m)
            if value:
                col[out_of[node]] += value
        exclusive[m] = col
    meta = dict(snap.meta)
    meta["view"] = MODEL
    meta["view_collapsed_nodes"] = collapsed
    return Snapshot(snap.metrics, frames, parents, exclusive, unavailable=snap.unavailable,
                    folded_nodes=snap.folded_nodes, meta=meta)


def pick_view(snap: Snapshot, view: str) -> Snapshot:
    """`snap` in `view` ("model" or "full")."""
    if view not in VIEWS:
        raise ValueError(f"unknown view {view!r}; choose one of {', '.join(VIEWS)}")
    return model_view(snap) if view == MODEL else snap
