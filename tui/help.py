"""The help screen (`?`) and the key line: both generated from the screens' and widgets' `BINDINGS`,
so a new or changed key shows up in them without a hand-written list to keep in step.

No privilege, no I/O.
"""

from __future__ import annotations

from typing import Iterable, Sequence

from rich.table import Table
from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.keys import format_key
from textual.screen import ModalScreen
from textual.widgets import Static

Group = tuple[str, Sequence[Binding]]  # a title ("tree", "flame", …) and its bindings


def keys_of(binding: Binding) -> str:
    """The keys of a binding as a person types them: "t,1" → "t 1", "slash" → "/"."""
    return " ".join(format_key(k.strip()) for k in binding.key.split(","))


def what_of(binding: Binding) -> str:
    """What a binding does: its description, else its action ("cursor(-1)" → "cursor -1")."""
    if binding.description:
        return binding.description
    return binding.action.removeprefix("app.").replace("('", " ").replace("(", " ").rstrip("')").replace("_", " ")


def help_rows(groups: Iterable[Group]) -> list[tuple[str, str, str]]:
    """(group, keys, what) for every binding of every group, in declaration order."""
    return [(title, keys_of(b), what_of(b)) for title, bindings in groups for b in bindings]


def key_line(bindings: Sequence[Binding], *, first: str = "? help") -> str:
    """The one-line key reminder: the shown bindings (first key of each), after `first`."""
    parts = [first] if first else []
    parts += [f"{format_key(b.key.split(',')[0].strip())} {b.description}" for b in bindings if b.show and b.description]
    return "  ".join(parts)


class HelpScreen(ModalScreen):
    """Every key of the screen it was opened from, grouped by where it acts; any of esc, q, ?
    closes it."""

    BINDINGS = [
        Binding("escape,q,question_mark", "app.pop_screen", "close help"),
    ]
    DEFAULT_CSS = """
    HelpScreen { align: center middle; }
    HelpScreen > VerticalScroll { width: 76; max-width: 100%; height: 90%;
                                   background: $panel; border: round $accent; padding: 0 1; }
    #help-table { width: 100%; height: auto; }
    """

    def __init__(self, groups: Sequence[Group]) -> None:
        super().__init__()
        self.groups = list(groups)

    def rows(self) -> list[tuple[str, str, str]]:
        return help_rows(self.groups)

    def compose(self) -> ComposeResult:
        table = Table(box=None, show_header=True, header_style="bold", pad_edge=False, title="keys (esc closes)")
        table.add_column("where", style="dim")
        table.add_column("keys", style="bold cyan", no_wrap=True)
        table.add_column("does")
        last = ""
        for title, keys, what in self.rows():
            table.add_row(Text(title if title != last else ""), keys, what)
            last = title
        with VerticalScroll():
            yield Static(table, id="help-table")
