"""Target: an allocation-heavy loop (lists, dicts, strings, objects). argv[1] = stop file."""
import os
import sys


class Node:
    __slots__ = ("k", "v", "children")

    def __init__(self, k, v):
        self.k, self.v, self.children = k, v, []


def work():
    d = {}
    for i in range(3000):
        n = Node(str(i) * 3, [i] * 5)
        n.children.append({"i": i, "s": f"x{i}"})
        d[n.k] = n
    return sum(len(k) + len(n.v) for k, n in d.items())


def main():
    stop = sys.argv[1]
    expected = work()
    print("ready", flush=True)
    bad = n = 0
    while True:
        if work() != expected:
            bad += 1
        n += 1
        if os.path.exists(stop):
            break
    print(f"result={expected} mismatches={bad}", flush=True)


if __name__ == "__main__":
    main()
