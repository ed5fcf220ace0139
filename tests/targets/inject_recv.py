"""Target: the main thread blocked in a socket recv. argv[1] = Unix socket path to listen on;
the test connects, and the target prints what it received, then exits."""
import os
import socket
import sys


def main():
    path = sys.argv[1]
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path)
    srv.listen(1)
    print("ready", flush=True)
    conn, _ = srv.accept()
    data = conn.recv(100)
    print(f"received={data.decode()}", flush=True)
    conn.close()
    srv.close()
    os.unlink(path)


if __name__ == "__main__":
    main()
