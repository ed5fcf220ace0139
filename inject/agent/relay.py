"""The GPU records' way from the vendor's collector to the daemon.

The collector (``gpu/``) is started here with the agent's options, and hands its records to
``sink`` from its own threads (CUPTI's buffer callbacks): the sink never blocks, and drops and
counts what does not fit (JSON rows: at most ``max_gpu_queue``; raw buffers: at most
``max_raw_bytes`` not yet in the outbox). At each flush of the agent loop ``send`` moves them to
the channel, on the agent thread: raw buffers, buffer addresses and layouts in the order they came
(a layout must arrive before the buffers it describes), then JSON rows grouped by kind.
"""

import collections


class GpuRelay:
    def __init__(self, ch, cfg, note):
        self.ch = ch
        self.cfg = cfg                  # the agent's options, live (a config message may change them)
        self.note = note
        self.collector = None
        self.queue = collections.deque()        # (kind, row): JSON records
        self.dropped = 0                        # rows dropped: the queue was full
        self.max_queue = cfg["max_gpu_queue"]
        self.raw_queue = collections.deque()    # ("json", msg) | ("raw", (header, body)) | ("ref", ...), in order
        self.raw_in = 0                         # bytes queued (a collector's thread only)
        self.raw_out = 0                        # bytes sent on (the agent thread only)
        self.raw_dropped = 0                    # CUPTI buffers dropped (the daemon was too slow)

    def start(self, sub, note_error):
        """Selects and starts the collector of the GPU vendor the process uses (``gpu/``), with the
        agent's options; None stays when there is none, or it failed (said in a note)."""
        starting = None
        cfg = self.cfg
        try:
            col = sub("gpu").select_collector(sub, self.note)
            if col is not None and hasattr(col, "api_records"):
                col.api_records = bool(cfg["gpu_api_records"])
            if col is not None and hasattr(col, "raw"):
                col.raw = bool(cfg["gpu_raw"])
            if col is not None and hasattr(col, "periodic_flush"):
                col.periodic_flush = bool(cfg["gpu_flush"])
            if col is not None and hasattr(col, "finalize"):
                col.finalize = bool(cfg["gpu_finalize"])
            if col is not None and hasattr(col, "ref"):   # buffers read in place
                col.ref = bool(cfg["gpu_ref"])
                col.max_shipped = max(1, int(cfg["max_raw_bytes"]) >> 20)
            if col is not None:
                starting = col
                self.collector = col
                if not col.start(self.sink):
                    self.collector = None
        except BaseException as e:  # a collector must never take the agent (or target) down
            self.collector = None
            note_error("GPU collector unavailable", e, level="warning")
            if starting is not None:    # start() failed part-way: what it enabled is disabled
                try:
                    starting.stop()
                except BaseException as e2:
                    note_error("GPU collector stop failed", e2, level="warning")

    def sink(self, kind, rec):
        """Called from collector threads: never blocks, drops and counts when full."""
        if kind == "raw":
            n = len(rec[1])
            if self.raw_in - self.raw_out + n > self.cfg["max_raw_bytes"]:
                self.raw_dropped += 1
                return
            self.raw_in += n
            self.raw_queue.append(("raw", rec))
            return
        if kind == "rawref":           # (header, address, length): bounded by the collector
            self.raw_queue.append(("ref", rec))
            return
        if kind == "cupti_layout":
            self.raw_queue.append(("json", rec))
            return
        if len(self.queue) >= self.max_queue:
            self.dropped += 1
            return
        self.queue.append((kind, rec))

    def call(self, name, *args, default=None):
        """A collector call that not every collector has (buffers left in place are CUPTI's);
        never raises into the agent loop."""
        fn = getattr(self.collector, name, None)
        if fn is None:
            return default
        try:
            return fn(*args)
        except BaseException as e:
            self.note("warning", f"GPU collector {name} failed: {type(e).__name__}: {e}")
            return default

    def release(self, addrs):
        """The daemon has read these buffers in place: the collector may reuse them."""
        if type(addrs) is list:
            self.call("release", [a for a in addrs if type(a) is int])

    @property
    def raw_bytes(self):
        """Bytes of CUPTI buffers queued and not yet in the outbox."""
        return self.raw_in - self.raw_out

    @property
    def pending(self):
        """Records not yet in the outbox."""
        return bool(self.queue or self.raw_queue)

    def send(self):
        """What the outbox takes now, in order; the rest waits for the next flush."""
        rq, ch = self.raw_queue, self.ch
        while rq:
            kind, item = rq[0]
            if kind == "json":
                if not ch.send(item) and ch.out:
                    break                          # outbox full: retried (the layout must arrive)
            elif kind == "ref":                    # a buffer left in place: address and length
                head, addr, n = item
                if not ch.send({"t": "cupti_ref", "h": head, "a": addr, "n": n}):
                    if ch.out:
                        break                      # outbox full: retried (the buffer waits)
                    self.raw_dropped += 1          # never sendable: the buffer is reused
                    self.release([addr])
            elif ch.send_raw(*item):
                self.raw_out += len(item[1])
            else:
                break                          # outbox full: the rest waits for the socket
            rq.popleft()
        q = self.queue
        groups = {}
        n = 0
        while q and n < 50000:   # per flush (every 200 ms): up to 250k records/s
            kind, rec = q.popleft()
            groups.setdefault(kind, []).append(rec)
            n += 1
        for kind, recs in groups.items():
            for i in range(0, len(recs), 2000):
                chunk = recs[i:i + 2000]
                msg = {"t": kind, "r": chunk}
                if kind == "kernel":  # kernel names (long C++ names) once per message, rows by index
                    ids = {}
                    for r in chunk:
                        r[0] = ids.setdefault(r[0], len(ids))
                    msg["n"] = list(ids)
                if not self.ch.send(msg):
                    self.dropped += len(chunk)
