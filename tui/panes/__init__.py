"""The panes of `ProfileScreen` (tui/profile.py), one `TabPane` each: tree, flame, hotspots, advice, source.

No privilege. Each pane composes its own widgets (ids and classes as app.tcss names them) and draws
from a `View` the screen hands it; the screen keeps the state they share (snapshot, metric, window,
sort) and routes between them (a hotspot or an advice finding opens its node in the tree).
"""

from stacklens.tui.panes.advice import AdviceFetched, AdvicePane
from stacklens.tui.panes.base import View, put
from stacklens.tui.panes.flame import FlamePane
from stacklens.tui.panes.hotspots import HotspotCache, HotspotsPane
from stacklens.tui.panes.source import SourcePane
from stacklens.tui.panes.tree import TreePane

__all__ = [
    "AdviceFetched", "AdvicePane", "FlamePane", "HotspotCache", "HotspotsPane", "SourcePane", "TreePane", "View", "put",
]
