"""Target: a hostile 'agent' that floods the daemon with samples of unique frames (issue 17).

stdin line 1: socket path, token and the number of unique frames to send (a compromised agent
knows the path and token). Frames carry strings at the daemon's cut lengths (1024-char files,
512-char names: what it keeps of any longer one) and, every 64th, an 8 KiB one (cut). Prints
'ready', then 'sent' after its 'bye'; exits on the next stdin line."""
import json
import socket
import struct
import sys


def frame(obj):
    data = json.dumps(obj).encode()
    return struct.pack(">I", len(data)) + data


def main():
    path, token, n = sys.stdin.readline().split()
    n = int(n)
    print("ready", flush=True)
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(path)
    s.sendall(frame({"t": "hello", "v": 1, "pid": 1, "tid": 1, "python": [3, 11, 0], "token": token}))
    depth, per_msg = 4, 120                      # 480 frames, ~0.85 MiB a message (1 MiB max)
    i = 0
    while i < n:
        stacks = []
        for _ in range(per_msg):
            st = []
            for d in range(depth):
                long = i % 64 == 0
                f = f"/evil/{i:012d}/{d}".ljust(8192 if long else 1024, "f")
                fn = f"fn{i:012d}_{d}".ljust(8192 if long else 512, "g")
                st.append([f, fn, d])
                i += 1
            stacks.append(st)
        msg = {"t": "samples", "stacks": stacks, "s": [[7, i, k, 0] for k in range(len(stacks))]}
        s.sendall(frame(msg))
    s.sendall(frame({"t": "bye"}))
    print("sent", flush=True)
    sys.stdin.readline()
    s.close()


if __name__ == "__main__":
    main()
