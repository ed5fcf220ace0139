"""Target: a steady loop through a stripped library (tests/fakes/fake_cuda_stripped.c, -s).

argv: LIBPATH. Prints `ready`; each line `run SECONDS` calls sl_steady_step (8 launches per
call) for that long from one Python function and prints `done CALLS`; an empty line exits.
"""

import ctypes
import sys
import time

lib = ctypes.CDLL(sys.argv[1])
lib.sl_steady_step.restype = ctypes.c_uint64
lib.sl_steady_step.argtypes = [ctypes.c_uint64, ctypes.c_int]


def steady(seconds: float) -> int:
    end = time.monotonic() + seconds
    x, n = 1, 0
    while time.monotonic() < end:
        x = lib.sl_steady_step(x, 20000)
        n += 1
    return n


print("ready", flush=True)
for line in sys.stdin:
    cmd = line.split()
    if not cmd:
        break
    print(f"done {steady(float(cmd[1]))}", flush=True)
