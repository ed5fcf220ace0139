"""Target: a hot Python function whose location table is cut inside an entry.

Prints `ready`, then calls `hot` until killed. Its co_linetable is swapped (ctypes) for a copy cut
right after the first byte of an entry that goes on with a varint: what a line table freed and
reused under a reader can look like (issue 26: such a table raised IndexError out of the
symbolizer and ended the session). CPython reads the table only for a traceback or a line
number, which `hot` never gives. `cut_table` and `swap_linetable` serve dataloader_epochs.py too.
"""

import ctypes
import struct
import sys

_KEEP: list = []


def cut_table(table: bytes) -> bytes:
    """The 3.11+ location table cut right after the first byte of its first entry that goes on
    with a varint (forms 13 and 14)."""
    i = 0
    while i < len(table):
        form = (table[i] >> 3) & 15
        if form in (13, 14):
            return table[:i + 1]
        i += 1 + (1 if form < 10 else 2 if form < 13 else 0)
    raise SystemExit("no varint entry in the location table")


def swap_linetable(code, table: bytes) -> None:
    """Points the code object's co_linetable field at `table`: the field is found as the word that
    holds the address of the current co_linetable object. The code object's dealloc drops the
    reference it thinks it holds: `table` gets one more here; the old table is kept (leaked)."""
    old = code.co_linetable
    raw = ctypes.string_at(id(code), sys.getsizeof(code))
    off = next(i for i in range(0, len(raw) - 7, 8) if struct.unpack_from("<Q", raw, i)[0] == id(old))
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(table))
    _KEEP.append(old)
    ctypes.c_uint64.from_address(id(code) + off).value = id(table)


def hot(n):
    s = 0
    for i in range(n):
        s += (i * i) % 7
    return s


if __name__ == "__main__":
    if sys.version_info < (3, 11):
        raise SystemExit("3.11+ location tables only")
    swap_linetable(hot.__code__, cut_table(hot.__code__.co_linetable))
    print("ready", flush=True)
    while True:
        hot(20_000)
