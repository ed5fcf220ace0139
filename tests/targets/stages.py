"""A pure-Python pipeline whose stages have known costs, for comparing profilers (issue 22).

Thread "pipeline" (the main thread) loops preprocess (30% of its work), encoder (50%) and head
(20%); thread "logger" runs log_metrics for ~1 ms every 50 ms. Both are named for the kernel
(prctl PR_SET_NAME: /proc/PID/task/TID/comm) as well as for `threading`. Prints `ready` once
both run, then loops until killed.

The ground truth: each stage's thread CPU time is counted as it runs. Given a file (argv[1]),
every SIGUSR1 appends one JSON line with each function's CPU seconds so far (the stage running at
that instant included up to it); two signals bracket a window.
"""

import ctypes
import json
import random
import signal
import sys
import threading
import time

UNIT = 100_000   # loop iterations per unit of work (~4 ms), on average

# Each function has its own loop, so it is the innermost Python frame of its samples. Stages of
# milliseconds make a sampler at a fixed period measure them closely: each is sampled at evenly
# spaced points many times over, instead of the error of independent draws (±1.6 points at
# 1,000 samples). Their lengths vary (0.8-1.2x, seeded), so a cycle never locks onto the period.
_rng = random.Random(22)


def _units(n):
    return range(int(n * UNIT * (0.8 + 0.4 * _rng.random())))


def preprocess():
    s = 0
    for i in _units(3):
        s += i * i
    return s


def encoder():
    s = 0
    for i in _units(5):
        s += i * i
    return s


def head():
    s = 0
    for i in _units(2):
        s += i * i
    return s


def log_metrics():
    s = 0
    for i in range(UNIT // 4):
        s += i * i
    return s


def _name(name):
    ctypes.CDLL(None).prctl(15, name.encode(), 0, 0, 0)   # PR_SET_NAME: this thread's comm
    threading.current_thread().name = name


def logger(started):
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})   # reports go to the main thread
    _name("logger")
    started.set()
    while True:
        t0 = time.thread_time_ns()
        log_metrics()
        spent["log_metrics"] += time.thread_time_ns() - t0
        time.sleep(0.05)


spent = {"preprocess": 0, "encoder": 0, "head": 0, "log_metrics": 0}   # thread CPU ns
running = [None, 0]   # the main thread's stage and its start (thread CPU ns)


def timed(fn):
    running[:] = [fn.__name__, time.thread_time_ns()]
    fn()
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})   # a report sees both steps or neither
    spent[fn.__name__] += time.thread_time_ns() - running[1]
    running[0] = None
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGUSR1})


def report(signum, frame):   # runs on the main thread, between two of its bytecodes
    now = dict(spent)
    if running[0] is not None:
        now[running[0]] += time.thread_time_ns() - running[1]
    with open(sys.argv[1], "a") as f:
        f.write(json.dumps({k: v / 1e9 for k, v in now.items()}) + "\n")


if len(sys.argv) > 1:
    signal.signal(signal.SIGUSR1, report)
started = threading.Event()
threading.Thread(target=logger, args=(started,), daemon=True).start()
started.wait()
_name("pipeline")
print("ready", flush=True)
while True:
    timed(preprocess)
    timed(encoder)
    timed(head)
