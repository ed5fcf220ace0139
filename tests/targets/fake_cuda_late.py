"""Target: maps no GPU library at first; loads LIBDIR/libcuda.so.1 (or LIBDIR/nosyms/...) on request.

argv: LIBDIR [nosyms|late|exit]. Prints `ready`. Lines on stdin: `load` -> dlopen, print `loaded`;
`go N` -> N cuLaunchKernel calls, print `done`. Mode `nosyms` loads the symbol-less libcuda at
start; mode `exit` exits 0.3 s after `ready` (to exit while someone attaches).
"""

import ctypes
import sys
import time

libdir = sys.argv[1]
mode = sys.argv[2] if len(sys.argv) > 2 else "late"
lib = None
if mode == "nosyms":
    lib = ctypes.CDLL(f"{libdir}/nosyms/libcuda.so.1")
print("ready", flush=True)
if mode == "exit":
    time.sleep(0.3)
    sys.exit(0)
for line in sys.stdin:
    cmd = line.split()
    if not cmd:
        break
    if cmd[0] == "load":
        lib = ctypes.CDLL(f"{libdir}/libcuda.so.1")
        print("loaded", flush=True)
    elif cmd[0] == "go":
        for _ in range(int(cmd[1])):
            lib.cuLaunchKernel(None, 1, 1, 1, 1, 1, 1, 0, None, None, None)
        print("done", flush=True)
