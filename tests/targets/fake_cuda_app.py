"""Target: calls the fake libcuda from known Python functions a known number of times.

argv: LIBDIR [N_FORWARD M_BACKWARD]. Prints `ready`, waits for a line on stdin, runs the
scenario, prints `done`, waits for another line, exits. Every count is fixed and echoed.
"""

import ctypes
import sys

from fake_slept import slept

libdir = sys.argv[1]
N = int(sys.argv[2]) if len(sys.argv) > 2 else 7
M = int(sys.argv[3]) if len(sys.argv) > 3 else 5

cuda = ctypes.CDLL(f"{libdir}/libcuda.so.1")
app = ctypes.CDLL(f"{libdir}/libfakeapp.so")
app.app_forward_launches.argtypes = [ctypes.c_void_p, ctypes.c_int]
app.app_backward_launches.argtypes = [ctypes.c_void_p, ctypes.c_int]
app.app_ex_launches.argtypes = [ctypes.c_void_p, ctypes.c_int]
cuda.cuMemAlloc_v2.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.c_size_t]
cuda.cuMemFree_v2.argtypes = [ctypes.c_uint64]
for name in ("cuMemcpyHtoD_v2", "cuMemcpyDtoH_v2", "cuMemcpyDtoD_v2", "cuMemcpyHtoDAsync_v2"):
    getattr(cuda, name).argtypes = [ctypes.c_uint64, ctypes.c_uint64, ctypes.c_size_t] + (
        [ctypes.c_void_p] if "Async" in name else [])
cuda.cuStreamSynchronize.argtypes = [ctypes.c_void_p]


def get_function(name: bytes) -> int:
    f = ctypes.c_void_p()
    cuda.cuModuleGetFunction(ctypes.byref(f), None, name)
    return f.value


def forward(f, n):
    app.app_forward_launches(f, n)


def backward(f, m):
    app.app_backward_launches(f, m)


def memory():
    p = ctypes.c_uint64()
    cuda.cuMemAlloc_v2(ctypes.byref(p), 1 << 20)
    cuda.cuMemcpyHtoD_v2(p.value, 0x1000, 4096)
    cuda.cuMemcpyDtoH_v2(0x2000, p.value, 8192)
    cuda.cuMemcpyDtoD_v2(p.value, p.value, 512)
    cuda.cuMemcpyHtoDAsync_v2(p.value, 0x1000, 256, 0x77)
    cuda.cuMemFree_v2(p.value)
    return p.value


def sync():
    cuda.cuStreamSynchronize(ctypes.c_void_p(0x99))


print("ready", flush=True)
sys.stdin.readline()
fwd = get_function(b"fwd_kernel")
bwd = get_function(b"bwd_kernel")
forward(fwd, N)
backward(bwd, M)
app.app_ex_launches(fwd, 3)
ptr = memory()
sync()
print(f"done {fwd} {bwd} {ptr} {slept(cuda)}", flush=True)
sys.stdin.readline()
