"""Target: launches through the fake libcuda from two Python functions in a 3:1 ratio, and
counts the launches it made while it was being profiled.

argv: LIBDIR [ACTIVE_S]. Prints `ready`, then loops. It knows it is profiled when the first
byte of its own cuLaunchKernel is an int3 (0xCC: the uprobe's breakpoint, installed on attach
and removed on detach). From the first probed batch it launches for ACTIVE_S seconds (default
3.0, inside a 5 s profile window: no launch falls between the profiler's snapshot and its
detach), paced to ~4,000 launches/s so the one-shot profiler never has to drop any, then
prints `done A B` (launches from launch_a and from launch_b, counted only while probed). Then,
for each stdin line `window START_NS END_NS` (a one-shot profile's window, CLOCK_MONOTONIC), it
prints `window A B`: the launches of the batches it began inside it (a batch is 3 + 1 launches,
stamped when it begins). Exits when stdin closes.
"""

import ctypes
import sys
import time

libdir = sys.argv[1]
ACTIVE_S = float(sys.argv[2]) if len(sys.argv) > 2 else 3.0

cuda = ctypes.CDLL(f"{libdir}/libcuda.so.1")
app = ctypes.CDLL(f"{libdir}/libfakeapp.so")
app.app_forward_launches.argtypes = [ctypes.c_void_p, ctypes.c_int]
app.app_backward_launches.argtypes = [ctypes.c_void_p, ctypes.c_int]
ENTRY = ctypes.cast(cuda.cuLaunchKernel, ctypes.c_void_p).value


def probed() -> bool:
    return ctypes.string_at(ENTRY, 1) == b"\xcc"


def get_function(name: bytes) -> int:
    f = ctypes.c_void_p()
    cuda.cuModuleGetFunction(ctypes.byref(f), None, name)
    return f.value


def launch_a(f):
    app.app_forward_launches(f, 1)


def launch_b(f):
    app.app_backward_launches(f, 1)


def main():
    while not probed():
        time.sleep(0.005)
    f = get_function(b"ratio_kernel")
    a = b = 0
    stamps = []
    end = time.monotonic() + ACTIVE_S
    while time.monotonic() < end:
        if not probed():
            break
        stamps.append(time.monotonic_ns())
        for _ in range(3):
            launch_a(f)
        launch_b(f)
        a += 3
        b += 1
        time.sleep(0.001)
    print(f"done {a} {b}", flush=True)
    for line in sys.stdin:
        _, start, stop = line.split()
        n = sum(1 for t in stamps if int(start) <= t <= int(stop))
        print(f"window {3 * n} {n}", flush=True)


print("ready", flush=True)
main()
