"""How frames and calling contexts are named for people: the TUI, the text report, Prometheus labels.

Pure, no privilege, no I/O; each call is O(1) per frame read. One place for the rules, so that a
hotspot on screen and its Prometheus series name the same frames:

- a frame: `func  file.py:88` for Python, `symbol [lib.so]` for native code, `[name]` for a
  synthetic frame, a module call as the model view names it, the name for every other kind
  (`frame_text`); or, for reports that must say exactly which frame, its full label (`full=True`);
- a context: its innermost Python frame and innermost operator, and (where the style names one) its
  leaf when the leaf is neither (`context_label`). The style only says how those parts are written:
  `METRIC_LABEL` (Prometheus `context`, a public interface: `model.py:forward:17 > aten::addmm >
  api:cuLaunchKernel`, bounded) or `ON_SCREEN` (the TUI's hotspots, whose frame column already
  shows the leaf: `forward  model.py:17 › aten::addmm`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable

from stacklens.cct.frames import Frame
from stacklens.cct.modelview import module_text


def _basename(path: str) -> str:
    return path.rsplit("/", 1)[-1]


def frame_text(frame: Frame, *, full: bool = False) -> str:
    """A frame for display: short (see the module docstring), or with `full` its label (which
    parses back, `Frame.from_label`), a module call still as the model view names it."""
    kind = frame.kind
    if kind == "module":
        return module_text(frame)
    if full:
        return frame.label()
    if kind == "python":
        return f"{frame.name}  {_basename(frame.file)}:{frame.line}"
    if kind == "native":
        lib = _basename(frame.file)
        return f"{frame.name} [{lib}]" if lib else frame.name
    if kind == "other":
        return f"[{frame.name}]"
    return frame.name


@dataclass(frozen=True)
class ContextStyle:
    """How the parts of a context are written; which parts there are is `context_label`'s rule."""

    python: Callable[[Frame], str]        # the innermost Python frame
    sep: str
    leaf: Callable[[Frame], str] | None   # None: the leaf is not named (the view shows it elsewhere)
    limit: int = 0                        # longer labels are cut to `limit` characters, "…" last; 0: never
    empty: str = ""                       # a context with no part (the root)


def _metric_leaf(frame: Frame) -> str:
    # kernel names are unbounded (templated C++): the label keeps their first 40 characters
    return "kernel:" + frame.name[:40] if frame.kind == "kernel" else frame.label()


METRIC_LABEL = ContextStyle(
    python=lambda f: f"{_basename(f.file)}:{f.name}:{f.line}", sep=" > ", leaf=_metric_leaf, limit=120,
    empty="[root]",
)
ON_SCREEN = ContextStyle(python=frame_text, sep=" › ", leaf=None)


def context_label(frames_up: Iterable[Frame], style: ContextStyle = METRIC_LABEL) -> str:
    """Name a context by its innermost Python frame, its innermost operator and (`style.leaf`) its
    leaf where the leaf is neither. `frames_up` runs from the leaf to the outermost caller
    (`reversed(snap.path(node))`, or a walk up the parents), read only until both are found."""
    leaf = py = op = None
    for f in frames_up:
        if leaf is None:
            leaf = f
        if f.kind == "python" and py is None:
            py = f
        elif f.kind == "op" and op is None:
            op = f
        if py is not None and op is not None:
            break
    parts = []
    if py is not None:
        parts.append(style.python(py))
    if op is not None:
        parts.append(op.name)
    if style.leaf is not None and leaf is not None and leaf.kind not in ("python", "op"):
        parts.append(style.leaf(leaf))
    label = style.sep.join(parts) or style.empty
    if style.limit and len(label) > style.limit:
        label = label[: style.limit - 1] + "…"
    return label
