"""A batch-1 decode step's shape on CPU (benchmarks/bench_launch_cost.py): each step runs
LAYERS layers of small "kernels" launched one by one from Python lines, through the fake
libcuda (tests/fakes/fake_cuda.c), as an eager decoder launches each op's kernel from its line.

argv: LIBDIR [CPU]; pinned to CPU when given. Prints `ready`; each line `steps N` runs N steps
and prints `done LAUNCHES SECONDS CPU_SECONDS` (the main thread's CPU time); an empty line exits.
"""

import ctypes
import os
import sys
import time

if len(sys.argv) > 2:
    os.sched_setaffinity(0, {int(sys.argv[2])})
cuda = ctypes.CDLL(f"{sys.argv[1]}/libcuda.so.1")
cuLaunchKernel = cuda.cuLaunchKernel
cuLaunchKernel.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 7 + [ctypes.c_void_p] * 3
LAYERS = 12
launches = 0


def kernel(fn: int) -> None:
    global launches
    launches += 1
    cuLaunchKernel(fn, 1, 1, 1, 128, 1, 1, 0, None, None, None)


def attention(x):
    kernel(0x10)        # qkv projection
    kernel(0x11)        # scores
    kernel(0x12)        # softmax
    kernel(0x13)        # output projection
    return x


def mlp(x):
    kernel(0x20)        # up projection
    kernel(0x21)        # activation
    kernel(0x22)        # down projection
    return x


def layer(x):
    kernel(0x30)        # norm
    x = attention(x)
    kernel(0x31)        # residual add
    x = mlp(x)
    kernel(0x32)        # residual add
    return x


def step(x):
    for _ in range(LAYERS):
        x = layer(x)
    kernel(0x40)        # lm head
    kernel(0x41)        # argmax
    return x


print("ready", flush=True)
for line in sys.stdin:
    cmd = line.split()
    if not cmd:
        break
    n0, t0, c0 = launches, time.perf_counter(), time.thread_time()
    for _ in range(int(cmd[1])):
        step(0)
    print(f"done {launches - n0} {time.perf_counter() - t0:.6f} {time.thread_time() - c0:.6f}", flush=True)
