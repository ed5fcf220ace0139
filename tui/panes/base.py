"""What the panes share: the `View` they draw and `put`, the update of a Static that skips no-ops."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from textual.widgets import Static

from stacklens.tui.model import Unit, unit_of

_UNSET = object()


@dataclass(frozen=True)
class View:
    """The screen's state as the panes draw it."""

    snap: Any          # the snapshot shown (the model view of the fetched one, or that one); None before the first
    metric: str
    diff: bool
    sort: str
    collapse_chains: bool
    empty: str         # why there is nothing to draw ("" when there is something)

    @property
    def unit(self) -> Unit:
        """How the metric's values are shown (CPU samples as time where the rate is known)."""
        return unit_of(self.snap, self.metric)


def put(widget: Static, content: Any, *, layout: bool = False, display: bool | None = None) -> None:
    """Update a Static only if what it shows changed. `layout=False` (the default) is for the
    one-line bars, whose size never changes: a layout pass re-renders the whole screen, which
    cost ~60 ms per status update in docs/benchmarks/tui.md."""
    if getattr(widget, "_put_shown", _UNSET) != content:
        widget._put_shown = content
        widget.update(content, layout=layout)
    if display is not None and widget.display != display:
        widget.display = display
