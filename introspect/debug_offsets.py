"""The one reader of `_Py_DebugOffsets`' header: the struct CPython 3.13+ puts at the start of
`_PyRuntime` to describe its own layout (cookie ``xdebugpy``, ``PY_VERSION_HEX``,
``free_threaded``, then u64 offsets in an order each minor version fixes).

Pure parsing of bytes read at ``&_PyRuntime``: no privilege, no process access. Used by the
CPython locator (introspect/cpython.py, for the version) and the version table
(introspect/python_layouts.py: 3.13+ layouts, PEP 768's fields), which names the fields after the
header.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

DEBUG_COOKIE = b"xdebugpy"
DEBUG_HEADER = struct.Struct("<8sQQ")   # cookie, PY_VERSION_HEX, free_threaded


@dataclass(frozen=True)
class DebugOffsetsHeader:
    """The start of `_Py_DebugOffsets` (3.13+: the first bytes of `_PyRuntime`); u64 offsets of
    the interpreter's own structures follow it, in an order each minor version fixes."""

    hexversion: int
    free_threaded: bool

    @property
    def version(self) -> tuple[int, int]:
        return (self.hexversion >> 24) & 0xFF, (self.hexversion >> 16) & 0xFF


def parse_debug_header(blob: bytes) -> DebugOffsetsHeader | None:
    """The header at the start of ``blob`` (bytes read at ``&_PyRuntime``), or None when the
    cookie is not there (before 3.13, or a build without debug offsets)."""
    if len(blob) < DEBUG_HEADER.size:
        return None
    cookie, hexversion, free_threaded = DEBUG_HEADER.unpack_from(blob)
    if cookie != DEBUG_COOKIE:
        return None
    return DebugOffsetsHeader(hexversion, bool(free_threaded))
