"""Target: calls the fake libamdhip64 (HIP) a known number of times.

argv: LIBDIR [N]. Prints `ready`, waits for a line, runs, prints `done STUB`, waits, exits.
"""

import ctypes
import sys

from fake_slept import slept


class Dim3(ctypes.Structure):
    _fields_ = [("x", ctypes.c_uint32), ("y", ctypes.c_uint32), ("z", ctypes.c_uint32)]


libdir = sys.argv[1]
N = int(sys.argv[2]) if len(sys.argv) > 2 else 4
hip = ctypes.CDLL(f"{libdir}/libamdhip64.so")
hip.hipLaunchKernel.argtypes = [ctypes.c_void_p, Dim3, Dim3, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
hip.hipModuleLaunchKernel.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 7 + [ctypes.c_void_p] * 3
hip.hipMalloc.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t]
hip.hipFree.argtypes = [ctypes.c_void_p]
hip.hipMemcpy.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
hip.hipStreamSynchronize.argtypes = [ctypes.c_void_p]
stub = ctypes.cast(hip.fake_hip_vector_add_stub, ctypes.c_void_p).value


def launch(n):
    for _ in range(n):
        hip.hipLaunchKernel(stub, Dim3(10, 20, 30), Dim3(64, 2, 1), None, 512, 0x4242)


def module_launch(n):
    f = ctypes.c_void_p()
    hip.hipModuleGetFunction(ctypes.byref(f), None, b"hip_gemm")
    for _ in range(n):
        hip.hipModuleLaunchKernel(f, 5, 6, 7, 8, 9, 10, 256, 0x4343, None, None)


def memory():
    p = ctypes.c_void_p()
    hip.hipMalloc(ctypes.byref(p), 65536)
    hip.hipMemcpy(p, 0x1000, 1000, 1)
    hip.hipMemcpy(0x2000, p, 2000, 2)
    hip.hipFree(p)


print("ready", flush=True)
sys.stdin.readline()
launch(N)
module_launch(2)
memory()
hip.hipStreamSynchronize(0x4242)
print(f"done {stub} {slept(hip)}", flush=True)
sys.stdin.readline()
