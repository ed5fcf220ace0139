"""Target: a hostile 'agent' that connects to the daemon's socket and sends garbage.
argv[1] = socket path, argv[2] = token (a compromised agent knows it). Prints 'done'."""
import json
import socket
import struct
import sys


def frame(obj):
    data = obj if isinstance(obj, bytes) else json.dumps(obj).encode()
    return struct.pack(">I", len(data)) + data


def connect(path):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(path)
    return s


def main():
    path, token = sys.argv[1], sys.argv[2]
    print("ready", flush=True)
    sys.stdin.readline()
    # 1. a hello with a wrong token
    s = connect(path)
    s.sendall(frame({"t": "hello", "v": 1, "pid": 1, "tid": 1, "python": [3, 11, 0], "token": "x"}))
    s.recv(10)
    s.close()
    # 2. an oversize frame
    s = connect(path)
    s.sendall(struct.pack(">I", 0xFFFFFFF0) + b"x" * 100)
    s.recv(10)
    s.close()
    # 3. a valid hello, then garbage of every kind, then one valid sample
    s = connect(path)
    s.sendall(frame({"t": "hello", "v": 1, "pid": 1, "tid": 1, "python": [3, 11, 0], "token": token}))
    bad = [b"not json", b"[1,2,3]", {"t": "exec", "code": "import os"}, {"t": "samples"},
           {"t": "samples", "stacks": [[["f", "g", -1]]], "s": [[1, 2, 0, 0]]},
           {"t": "samples", "stacks": [], "s": [[1, 2, 5, 0]]},
           {"t": "kernel", "r": [["k", 10, 5, 0, 0, 0, 1, 1, 1, 1, 1, 1, 0]]},
           {"t": "kernel", "r": [["k", "1", 5, 0, 0, 0, 1, 1, 1, 1, 1, 1, 0]]},
           {"t": "api", "r": [["evil", "x", 1, 1, 2, 3, 4]]},
           {"t": "note", "level": "critical", "msg": "x"},
           {"t": "memcpy", "r": [["HtoD", 2 ** 70, 1, 2, 0, 0, 0]]},
           {"t": "sync", "r": [["stream", 1, 2, 0]]},
           b"{" * 100000,
           {"t": "stats", "samples": 1, "sample_hz": float("nan"), "sample_cost_us": 1}]
    for b in bad:
        s.sendall(frame(b) if not isinstance(b, bytes) or not b.startswith(b"{") else frame(b))
    s.sendall(frame({"t": "samples", "stacks": [[["a.py", "f", 1]]], "s": [[7, 123, 0, 0]]}))
    s.sendall(frame({"t": "bye"}))
    s.close()
    print("done", flush=True)


if __name__ == "__main__":
    main()
