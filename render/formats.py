"""The output formats of a profile, listed once: name → renderer, media type, file extension.

No privilege, no I/O: a renderer turns a `Snapshot` into text or bytes; `stacklens report`,
`profile` and `record` (cli/main.py) write them. Renderers import their exporter when called, so
the command line starts without loading every exporter. A new format is one `Format` line here.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from stacklens.cct import Snapshot


@dataclass(frozen=True, slots=True)
class Format:
    name: str
    render: Callable[[Snapshot, str], str | bytes]  # (snapshot, metric) → the file's content
    media_type: str
    extension: str
    binary: bool = False        # never written to a terminal
    per_metric: bool = True     # renders the one metric asked for (else every metric)
    shows_notes: bool = False   # carries the snapshot's meta notes (a one-shot's account)
    # `--view auto` renders the model view (cct/modelview.py) where the profile has module calls;
    # formats other tools read stay complete unless `--view model` asks (docs/decisions.md)
    model_view: bool = False


def _text(snap: Snapshot, metric: str) -> str:
    from stacklens.render.textreport import render_report

    return render_report(snap, metric)


def _json(snap: Snapshot, metric: str) -> str:
    from stacklens.cct import export

    return json.dumps(export.to_json(snap), separators=(",", ":")) + "\n"


def _folded(snap: Snapshot, metric: str) -> str:
    from stacklens.render.folded import to_folded

    return to_folded(snap, metric)


def _pprof(snap: Snapshot, metric: str) -> bytes:
    from stacklens.render.pprof import to_pprof

    return to_pprof(snap)


def _speedscope(snap: Snapshot, metric: str) -> str:
    from stacklens.render.speedscope import to_speedscope

    return json.dumps(to_speedscope(snap, metric)) + "\n"


FORMATS: dict[str, Format] = {f.name: f for f in (
    Format("text", _text, "text/plain; charset=utf-8", ".txt", shows_notes=True, model_view=True),
    Format("json", _json, "application/json", ".json", per_metric=False, shows_notes=True),
    Format("folded", _folded, "text/plain; charset=utf-8", ".folded"),
    Format("pprof", _pprof, "application/vnd.google.protobuf+gzip", ".pb.gz", binary=True, per_metric=False),
    Format("speedscope", _speedscope, "application/json", ".speedscope.json"),
)}
