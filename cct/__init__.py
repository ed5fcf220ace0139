"""stacklens.cct: the calling context tree, its snapshots, windows and exports.

Pure: imports only the standard library and `stacklens.errors` (enforced by import-linter and
tests/unit/test_import_purity.py). No privilege, no I/O except `export.save` / `export.load`.
"""

from .frames import KINDS, Frame
from .snapshot import Snapshot
from .tree import CCT, METRICS
from .window import WindowedCCT, diff, merge

__all__ = ["CCT", "KINDS", "METRICS", "Frame", "Snapshot", "WindowedCCT", "diff", "merge"]
