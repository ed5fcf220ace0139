"""stacklens.cct: the calling context tree, its snapshots, windows and saved forms (export.py).

Pure: imports only the standard library and `stacklens.errors` (enforced by import-linter and
tests/unit/test_import_purity.py). No privilege, no I/O except `export.save` / `export.load`.
"""

from stacklens.cct.frames import KINDS, Frame
from stacklens.cct.snapshot import Snapshot
from stacklens.cct.tree import CCT, METRICS
from stacklens.cct.window import WindowedCCT, diff, growth, merge

__all__ = ["CCT", "KINDS", "METRICS", "Frame", "Snapshot", "WindowedCCT", "diff", "growth", "merge"]
