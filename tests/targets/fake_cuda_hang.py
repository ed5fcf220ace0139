"""Target: launches a kernel through the fake libcuda, then waits in cuCtxSynchronize for as
long as FAKE_SYNC_US says (the tests set it long: a job hung behind its GPU work).

argv: LIBDIR. Prints `ready`, waits for a line on stdin (tests/targets/stdin_commands.py),
then runs `step()`: the launch on the line marked LAUNCH, the wait on the line marked WAIT.
"""

import ctypes
import sys

from stdin_commands import commands

cuda = ctypes.CDLL(f"{sys.argv[1]}/libcuda.so.1")


def step() -> None:
    f = ctypes.c_void_p()
    cuda.cuModuleGetFunction(ctypes.byref(f), None, b"long_kernel")
    cuda.cuLaunchKernel(f, 1, 1, 1, 1, 1, 1, 0, None, None, None)  # LAUNCH
    cuda.cuCtxSynchronize()  # WAIT


print("ready", flush=True)
for _ in commands():
    step()
    print("done", flush=True)
