"""Textual widgets of the TUI, one module each; the panes (tui/panes/) and the tests take them from here.

- tui/cctview.py: `CCTView`, the CCT as an expandable tree of lines (Line API, renders only visible rows);
- tui/icicleview.py: `IcicleView`, the flame graph (top down);
- tui/linetable.py: `LineTable`, the hotspots table;
- tui/linecache.py: the rendered-line cache the first two share.

No privilege. The widgets hold rows computed by `tui.model`; expansion state lives in the panes,
which the widgets tell through messages.
"""

from stacklens.tui.cctview import CCTView, header_text
from stacklens.tui.icicleview import IcicleView
from stacklens.tui.linetable import LineTable

__all__ = ["CCTView", "IcicleView", "LineTable", "header_text"]
