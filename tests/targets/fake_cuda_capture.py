"""Target: a stream capture on the fake libcuda (tests/bpf/test_graph_capture.py).

argv: LIBDIR N. Prints `ready`, waits for a line on stdin, then: one launch before the capture,
cuStreamBeginCapture_v2, N launches from `captured` (the graph's nodes), cuStreamEndCapture, one
graph launch; prints `done`, waits for another line, exits.
"""

import ctypes
import sys

libdir = sys.argv[1]
N = int(sys.argv[2])
cuda = ctypes.CDLL(f"{libdir}/libcuda.so.1")
cuda.cuLaunchKernel.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 7 + [ctypes.c_void_p] * 3
cuda.cuStreamBeginCapture_v2.argtypes = [ctypes.c_void_p, ctypes.c_int]
cuda.cuStreamEndCapture.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p)]
cuda.cuGraphLaunch.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
STREAM = 0x5151


def get_function(name: bytes) -> int:
    f = ctypes.c_void_p()
    cuda.cuModuleGetFunction(ctypes.byref(f), None, name)
    return f.value


def launch(f):
    cuda.cuLaunchKernel(f, 1, 1, 1, 32, 1, 1, 0, STREAM, None, None)


def captured(f, n):
    for _ in range(n):
        launch(f)                                   # CAPTURED_LINE


print("ready", flush=True)
sys.stdin.readline()
k = get_function(b"node_kernel")
launch(k)
cuda.cuStreamBeginCapture_v2(STREAM, 0)
captured(k, N)
g = ctypes.c_void_p()
cuda.cuStreamEndCapture(STREAM, ctypes.byref(g))
cuda.cuGraphLaunch(0x7a7a, STREAM)
print("done", flush=True)
sys.stdin.readline()
