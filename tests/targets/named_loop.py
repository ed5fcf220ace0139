"""A target that burns CPU in a function whose name is given on the command line.

Prints `ready` and loops until killed. Used to check that each attached process gets its own tree.
"""

import sys

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


def main_loop():
    while True:
        fn(20_000)


print("ready", flush=True)
main_loop()
