"""Target: calls the versioned exports of the fake libcuda, as programs built against newer
headers do (cuda.h #defines cuCtxSynchronize to cuCtxSynchronize_v2; per-thread default stream
builds call the _ptsz / _ptds exports), plus the legacy names.

argv: LIBDIR ROUNDS. Prints `ready`, waits for a line, runs ROUNDS rounds, prints `done`, waits.
"""

import ctypes
import sys

from fake_slept import slept

libdir, rounds = sys.argv[1], int(sys.argv[2])
cuda = ctypes.CDLL(f"{libdir}/libcuda.so.1")
cuda.cuCtxSynchronize_v2.argtypes = [ctypes.c_void_p]
cuda.cuStreamSynchronize_ptsz.argtypes = [ctypes.c_void_p]
cuda.cuMemcpyHtoD_v2_ptds.argtypes = [ctypes.c_uint64, ctypes.c_uint64, ctypes.c_size_t]
cuda.cuMemcpyHtoDAsync_v2_ptsz.argtypes = [ctypes.c_uint64, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p]
cuda.cuMemcpyHtoD.argtypes = [ctypes.c_uint32, ctypes.c_uint64, ctypes.c_uint32]
cuda.cuLaunchKernel_ptsz.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 7 + [ctypes.c_void_p] * 3


def one_round():
    cuda.cuCtxSynchronize_v2(None)          # torch.cuda.synchronize() on CUDA 13
    cuda.cuCtxSynchronize()                 # the legacy entry: a wrapper around _v2 in the fake
    cuda.cuStreamSynchronize_ptsz(ctypes.c_void_p(0x77))
    cuda.cuLaunchKernel_ptsz(0xABC, 1, 1, 1, 32, 1, 1, 0, 0x77, None, None)
    cuda.cuMemcpyHtoD_v2_ptds(0x7f0000000000, 0x1000, 4096)
    cuda.cuMemcpyHtoDAsync_v2_ptsz(0x7f0000000000, 0x1000, 256, 0x77)
    cuda.cuMemcpyHtoD(0x1000, 0x1000, 64)   # 32-bit ABI of CUDA < 3.2: not probed


print("ready", flush=True)
sys.stdin.readline()
for _ in range(rounds):
    one_round()
print(f"done {slept(cuda)}", flush=True)
sys.stdin.readline()
