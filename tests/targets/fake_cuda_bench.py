"""Target for benchmarks/bench_probes.py: tight cuLaunchKernel loop in C (fake libcuda).

argv: LIBDIR. Prints `ready`; each line `loop N` runs N launches (C loop, no Python per call),
`paced N GAP_NS` one launch every GAP_NS, `deep D N` the N-launch loop called from D nested Python
frames; prints `done SECONDS`; an empty line exits.
"""

import ctypes
import sys
import time

cuda = ctypes.CDLL(f"{sys.argv[1]}/libcuda.so.1")
cuda.fake_cuda_launch_loop.argtypes = [ctypes.c_void_p, ctypes.c_ulonglong]
cuda.fake_cuda_launch_paced.argtypes = [ctypes.c_void_p, ctypes.c_ulonglong, ctypes.c_ulonglong]


def nest(d, n):
    if d > 1:
        return nest(d - 1, n)
    cuda.fake_cuda_launch_loop(0x1234, n)


print("ready", flush=True)
for line in sys.stdin:
    cmd = line.split()
    if not cmd:
        break
    t0 = time.perf_counter()
    if cmd[0] == "deep":  # deep D N
        nest(int(cmd[1]), int(cmd[2]))
    elif cmd[0] == "paced":  # paced N GAP_NS
        cuda.fake_cuda_launch_paced(0x1234, int(cmd[1]), int(cmd[2]))
    else:  # loop N
        cuda.fake_cuda_launch_loop(0x1234, int(cmd[1]))
    print(f"done {time.perf_counter() - t0:.6f}", flush=True)
