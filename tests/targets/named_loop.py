"""A target that burns CPU in a function whose name is given on the command line.

Prints `ready` and loops until killed. Used to check that each attached process gets its own tree.
argv[2] (optional): the share of each 20 ms that it burns (default 1: all of it), so that many
targets side by side leave the machine to the profiler and the CLI.
"""

import sys
import time

NAME = sys.argv[1]
ns: dict = {}
exec(
    f"def {NAME}(n):\n"
    "    s = 0\n"
    "    for i in range(n):\n"
    "        s += i * i\n"
    "    return s\n",
    ns,
)
fn = ns[NAME]


DUTY = float(sys.argv[2]) if len(sys.argv) > 2 else 1.0


def main_loop():
    while True:
        if DUTY >= 1.0:
            fn(20_000)
            continue
        t0 = time.monotonic()
        while time.monotonic() - t0 < 0.02 * DUTY:
            fn(2_000)
        time.sleep(0.02 * (1 - DUTY))


print("ready", flush=True)
main_loop()
