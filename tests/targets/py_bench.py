"""Benchmark target for pystack: calls os.getpid() (the probed "launch") at a chosen Python depth.

Prints `ready`; then per stdin line:
  `run N DEPTH`  -> N calls at DEPTH Python frames below main; prints ns per call
  `mix SECONDS`  -> calls from 40 distinct functions (mixed depths, a generator, a thread) for
                    SECONDS; prints the number of calls
  `quit`
"""

import os
import sys
import threading
import time


def at_depth(d, n):
    if d > 0:
        return at_depth(d - 1, n)
    getpid = os.getpid
    t0 = time.perf_counter_ns()
    for _ in range(n):
        getpid()
    return (time.perf_counter_ns() - t0) / n


def make_funcs(k):
    ns = {"os": os}
    src = "\n".join(
        f"def f{i}(n):\n    if n: return f{(i * 7 + 3) % k}(n - 1)\n    os.getpid()\n    return 1\n"
        for i in range(k))
    exec(compile(src, "generated_mix.py", "exec"), ns)
    return [ns[f"f{i}"] for i in range(k)]


def mix(seconds):
    funcs = make_funcs(40)
    stop = time.monotonic() + seconds
    calls = [0]

    def loop(offset):
        i = offset
        while time.monotonic() < stop:
            funcs[i % 40](i % 9)
            calls[0] += 1
            i += 1
            if i % 64 == 0:
                time.sleep(0.0005)

    t = threading.Thread(target=loop, args=(17,))
    t.start()
    loop(0)
    t.join()
    return calls[0]


def main():
    print("ready", flush=True)
    for line in sys.stdin:
        cmd = line.split()
        if not cmd or cmd[0] == "quit":
            break
        if cmd[0] == "run":
            print(at_depth(int(cmd[2]), int(cmd[1])), flush=True)
        elif cmd[0] == "mix":
            print(mix(float(cmd[1])), flush=True)


if __name__ == "__main__":
    main()
