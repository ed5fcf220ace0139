"""Target with a known call structure; every `os.getpid()` / libc `getpid()` is a "launch".

Prints `ready`, waits for a line on stdin, runs the scenarios, prints `done`, waits for EOF.
Lines marked `# @NAME` are looked up by tests/bpf/test_pystack.py. Counts are in COUNTS.
Stdlib only; runs on CPython 3.10-3.14.
"""

import asyncio
import ctypes
import os
import sys
import threading

COUNTS = {"abc": 7, "xy": 5, "thread": 4, "pre": 3, "gen": 6, "coro": 3, "rec": 2,
          "qsort": 4, "native": 3}
REC_DEPTH = 80

libc = ctypes.CDLL(None, use_errno=True)
libc.getpid.restype = ctypes.c_int


def c():
    os.getpid()  # @c


def b():
    c()  # @b


def a():
    b()  # @a


def y():
    os.getpid()  # @y


def x():
    y()  # @x


def t2():
    libc.getpid()  # @t2   (ctypes: the GIL is released during the call)


def t1():
    t2()  # @t1


def worker(n):
    for _ in range(n):
        t1()  # @worker


def p2():
    os.getpid()  # @p2


def pre_thread(go):
    go.wait()
    for _ in range(COUNTS["pre"]):
        p2()  # @pre


def gen(n):
    for i in range(n):
        os.getpid()  # @gen
        yield i


async def co_inner():
    os.getpid()  # @co_inner
    await asyncio.sleep(0)


async def co_outer(n):
    for _ in range(n):
        await co_inner()  # @co_outer


def rec(n):
    if n == 0:
        os.getpid()  # @rec_leaf
        return
    rec(n - 1)  # @rec


CMPFUNC = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_int), ctypes.POINTER(ctypes.c_int))


def cmp(p, q):
    os.getpid()  # @cmp
    return p[0] - q[0]


def sorter():
    arr = (ctypes.c_int * 2)(2, 1)
    for _ in range(COUNTS["qsort"]):
        arr[0], arr[1] = 2, 1
        libc.qsort(arr, 2, ctypes.sizeof(ctypes.c_int), CMPFUNC(cmp))  # @sorter


def native_threads(n):
    """pthreads whose start routine is libc getpid itself: no Python ever runs on them."""
    start = ctypes.cast(libc.getpid, ctypes.c_void_p)
    for _ in range(n):
        t = ctypes.c_ulong()
        libc.pthread_create(ctypes.byref(t), None, start, None)
        libc.pthread_join(t, None)


def main():
    go = threading.Event()
    pre = threading.Thread(target=pre_thread, args=(go,), name="pre")
    pre.start()
    print("ready", flush=True)
    sys.stdin.readline()
    late = threading.Thread(target=worker, args=(COUNTS["thread"],), name="late")
    late.start()  # started after attach
    go.set()
    for _ in range(COUNTS["abc"]):
        a()  # @main_a
    for _ in range(COUNTS["xy"]):
        x()  # @main_x
    late.join()
    pre.join()
    for _ in gen(COUNTS["gen"]):  # @main_gen
        pass
    asyncio.run(co_outer(COUNTS["coro"]))  # @main_coro
    for _ in range(COUNTS["rec"]):
        rec(REC_DEPTH)  # @main_rec
    sorter()  # @main_sorter
    native_threads(COUNTS["native"])
    print("done", flush=True)
    sys.stdin.read()


if __name__ == "__main__":
    main()  # @module
