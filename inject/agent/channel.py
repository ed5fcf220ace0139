"""The agent's connection to the daemon: non-blocking framed JSON (and raw CUPTI frames) over the
connected Unix socket, with a bounded outbox whose drops are counted. Runs on the agent thread;
collectors' threads may only append notes (the outbox's lock)."""

import collections
import math
import select
import sys
import threading
import time

# a module of the agent ("wire"), through the agent package (loaded before it)
_sub = sys.modules[__name__.rpartition(".")[0]]._sub


class Outbox:
    """Frames waiting for the socket: a queue of byte strings and an offset into the first, so a
    partial send never moves the rest (raw CUPTI frames are 1 MiB; a bytearray's `del out[:n]`
    after each ~200 KiB send moved megabytes per second on the target's GIL)."""

    def __init__(self):
        self.chunks = collections.deque()
        self.size = 0            # bytes not yet sent
        self.off = 0             # into chunks[0]
        self.lock = threading.Lock()   # notes may be sent from a collector's thread

    def __len__(self):
        return self.size

    def __bytes__(self):
        return b"".join(self.chunks)[self.off:]

    def append(self, *parts):
        with self.lock:
            self.chunks.extend(parts)
            self.size += sum(len(p) for p in parts)

    def send_to(self, sock):
        """Write what the socket takes now; raises OSError (not BlockingIOError) if it broke."""
        chunks = self.chunks
        while chunks:
            head = chunks[0]
            try:
                n = sock.send(memoryview(head)[self.off:])
            except (BlockingIOError, InterruptedError):
                return
            self.off += n
            with self.lock:
                self.size -= n
            if self.off < len(head):
                return           # the socket is full
            chunks.popleft()
            self.off = 0


class Channel:
    """Non-blocking framed JSON over the connected socket; a bounded outbox, drops counted."""

    def __init__(self, sock, max_outbox=4 << 20):
        self.wire = _sub("wire")
        self.sock = sock
        sock.setblocking(False)
        self.out = Outbox()
        self.inbuf = bytearray()
        self.max_outbox = max_outbox
        self.dropped_msgs = 0
        self.closed = False
        self.poller = select.poll()
        self.poller.register(sock.fileno(), select.POLLIN)
        self._want_out = False

    def send(self, msg):
        try:
            data = self.wire.encode(msg)
        except (TypeError, ValueError):
            self.dropped_msgs += 1
            return False
        if len(data) - 4 > self.wire.MAX_FRAME or len(self.out) + len(data) > self.max_outbox:
            self.dropped_msgs += 1
            return False
        self.out.append(data)
        return True

    def send_raw(self, header, body):
        """A raw frame (CUPTI buffer bytes); False when the outbox has no room for it now. The
        body is queued as it is (no copy of the buffer into a frame)."""
        prefix = self.wire.raw_prefix(header, len(body))
        n = len(prefix) + len(body)
        if n - 4 > self.wire.MAX_RAW_FRAME:
            self.dropped_msgs += 1
            return True               # never fits: consumed (and counted), not retried
        if len(self.out) + n > self.max_outbox:
            return False
        self.out.append(prefix, body)
        return True

    def pump(self, timeout_s):
        """Wait up to timeout_s; write what the socket takes, return complete incoming messages."""
        if self.closed:
            time.sleep(max(0.0, timeout_s))
            return []
        want = bool(self.out)
        if want != self._want_out:
            self.poller.modify(self.sock.fileno(), select.POLLIN | (select.POLLOUT if want else 0))
            self._want_out = want
        # poll() counts whole ms: round up. Rounded down, the last fraction of every wait of the
        # agent loop was a spin of poll(0) calls, each one giving the GIL away and taking it back
        # (24,000/s against a loop of small torch ops, 3,000/s against pure Python). A sample up to
        # 1 ms late is harmless: the schedule is absolute and jittered.
        events = self.poller.poll(math.ceil(timeout_s * 1000) if timeout_s > 0 else 0)
        msgs = []
        for _fd, ev in events:
            if ev & select.POLLOUT and self.out:
                try:
                    self.out.send_to(self.sock)
                except OSError:
                    self.closed = True
            if ev & (select.POLLIN | select.POLLHUP | select.POLLERR):
                try:
                    data = self.sock.recv(65536)
                except (BlockingIOError, InterruptedError):
                    data = None
                except OSError:
                    data = b""
                if data == b"":
                    self.closed = True
                elif data:
                    self.inbuf += data
                    msgs.extend(self._parse())
        return msgs

    def _parse(self):
        import json
        out = []
        while len(self.inbuf) >= 4:
            n = int.from_bytes(self.inbuf[:4], "big")
            if n > 65536:           # the daemon never sends this much: treat as a broken peer
                self.closed = True
                return out
            if len(self.inbuf) < 4 + n:
                break
            raw = bytes(self.inbuf[4:4 + n])
            del self.inbuf[:4 + n]
            try:
                msg = json.loads(raw)
            except ValueError:
                continue
            if isinstance(msg, dict) and isinstance(msg.get("t"), str):
                out.append(msg)
        return out

    def drain(self, timeout_s):
        """Blocking-ish flush of the outbox at detach, bounded by timeout_s."""
        end = time.monotonic() + timeout_s
        while self.out and not self.closed and time.monotonic() < end:
            self.pump(min(0.05, max(0.0, end - time.monotonic())))
