"""Target: launches from two native call sites in turn (forward, backward, forward, ...), as a
training step launches from many places. argv: LIBDIR ROUNDS. Prints `ready`, waits for a line,
runs ROUNDS x (one forward launch, one backward launch), prints `done`, waits for a line, exits."""

import ctypes
import sys

libdir, rounds = sys.argv[1], int(sys.argv[2])
cuda = ctypes.CDLL(f"{libdir}/libcuda.so.1")
app = ctypes.CDLL(f"{libdir}/libfakeapp.so")
app.app_forward_launches.argtypes = [ctypes.c_void_p, ctypes.c_int]
app.app_backward_launches.argtypes = [ctypes.c_void_p, ctypes.c_int]


def get_function(name: bytes) -> int:
    f = ctypes.c_void_p()
    cuda.cuModuleGetFunction(ctypes.byref(f), None, name)
    return f.value


print("ready", flush=True)
sys.stdin.readline()
fwd, bwd = get_function(b"fwd_kernel"), get_function(b"bwd_kernel")
for _ in range(rounds):
    app.app_forward_launches(fwd, 1)
    app.app_backward_launches(bwd, 1)
print("done", flush=True)
sys.stdin.readline()
