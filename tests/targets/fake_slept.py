"""What the fake GPU libraries (tests/fakes) measured of their own sleeps: `slept=NS,NS,...`, in
call order, the truth a probe's sync duration is checked against (on a loaded machine a 30 ms sleep
takes longer than 30 ms)."""

import ctypes

MAX = 256   # FAKE_SLEPT_MAX in tests/fakes/*.c


def slept(lib: ctypes.CDLL) -> str:
    n = min(ctypes.c_uint.in_dll(lib, "fake_sleeps").value, MAX)
    ns = (ctypes.c_ulonglong * MAX).in_dll(lib, "fake_slept_ns")
    return "slept=" + ",".join(str(ns[i]) for i in range(n))


def parse(line: str) -> list[int]:
    """The sleeps out of a target's line that carries a `slept=` field."""
    field = next(w for w in line.split() if w.startswith("slept="))[len("slept="):]
    return [int(x) for x in field.split(",") if x]
