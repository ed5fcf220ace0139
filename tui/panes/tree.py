"""The tree pane: the CCT as an expandable tree, its column header and an empty-profile message.

No privilege. Owns which rows are expanded (keys, so expansion survives new snapshots); drawing
costs the visible rows (tui.model.tree_rows), not the tree size.
"""

from __future__ import annotations

from typing import Any, Callable

from textual import on
from textual.app import ComposeResult
from textual.widgets import Static, TabPane

from stacklens.tui import model
from stacklens.tui.model import Row
from stacklens.tui.panes.base import View, put
from stacklens.tui.widgets import CCTView, header_text


class TreePane(TabPane):
    def __init__(self, title: str, *, view: Callable[[], View], id: str) -> None:
        super().__init__(title, id=id)
        self._view = view
        self.expanded: set = set()
        self._auto_expand = True

    def compose(self) -> ComposeResult:
        yield Static(id="tree-header")
        yield Static(id="tree-empty", classes="empty")
        yield CCTView(id="cct")

    # ---- expansion ---------------------------------------------------------------------------
    def auto_expand(self, snap: Any, metric: str) -> None:
        """Open the hot path of each new snapshot until something is expanded."""
        if self._auto_expand:
            self.expanded |= model.hot_path_keys(snap, metric)
            self._auto_expand = not self.expanded

    def expand_hot_if_hidden(self, snap: Any, metric: str) -> None:
        if snap is not None and not (self.expanded & model.hot_path_keys(snap, metric, max_depth=1)):
            self.expanded |= model.hot_path_keys(snap, metric)

    def reset_expansion(self) -> None:
        self.expanded = set()
        self._auto_expand = True

    def reveal(self, snap: Any, node: int) -> None:
        """Expand the tree down to `node` and put the cursor on its row."""
        self.expanded |= model.ancestor_keys(snap, node)
        self.refresh_tree()
        view = self.query_one(CCTView)
        idx = model.row_index_of(view.rows, node)
        if idx is not None:
            view.move_to(idx)

    # ---- drawing -----------------------------------------------------------------------------
    def show_message(self, text: str) -> None:
        put(self.query_one("#tree-empty", Static), text, layout=True, display=bool(text))

    def refresh_tree(self, *, keep: model.Key | None = None) -> None:
        v = self._view()
        view = self.query_one(CCTView)
        self.refresh_header()
        self.show_message(v.empty)
        if v.empty or v.snap is None:
            view.set_rows([], v.unit, 0)
            return
        if keep is None and view.current is not None:
            keep = view.current.key
        rows = model.tree_rows(v.snap, v.metric, self.expanded, sort=v.sort, collapse_chains=v.collapse_chains)
        cursor = None
        if keep is not None:
            cursor = model.row_index_of_key(rows, keep)
        view.set_rows(rows, v.unit, v.snap.total(v.metric), signed=v.diff, cursor=cursor)

    def refresh_header(self) -> None:
        v = self._view()
        width = self.query_one(CCTView).size.width or self.app.size.width
        put(self.query_one("#tree-header", Static), header_text(v.unit.label, v.sort, width, signed=v.diff))

    def selected_node(self) -> int | None:
        row = self.query_one(CCTView).current
        if row is None or row.more:
            return None
        return row.node

    # ---- tree events -------------------------------------------------------------------------
    @on(CCTView.Toggle)
    def _toggle(self, event: CCTView.Toggle) -> None:
        row: Row = event.row
        if row.more or not row.has_children:
            return
        expand = (not row.expanded) if event.expand is None else event.expand
        if expand:
            self.expanded.add(row.key)
        else:
            self.expanded = {k for k in self.expanded if k[: len(row.key)] != row.key}
        self._auto_expand = False
        self.refresh_tree(keep=row.key)

    @on(CCTView.ExpandHot)
    def _expand_hot(self, event: CCTView.ExpandHot) -> None:
        v = self._view()
        if v.snap is not None:
            key = event.row.key
            self.expanded.add(key)
            self.expanded |= {key + k[len(key) :] for k in model.hot_path_keys(v.snap, v.metric, event.row.node)}
            self.refresh_tree(keep=key)
