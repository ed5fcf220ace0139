"""Ring buffer reader that maps the BPF ring buffer itself: its data area and positions.

BCC's ring_buffer_poll calls a ctypes callback per record (~1 µs of Python per event before any
decoding); here the decoders (bpf/decode.py, bpf/shared.py) walk the mapped records with
struct.unpack_from and advance the consumer position once per batch. Requires the map fd of a
BPF_MAP_TYPE_RINGBUF (kernel >= 5.8).
"""

from __future__ import annotations

import mmap
import select
import struct
import time

_POS = struct.Struct("<Q")
BUSY = 1 << 31
DISCARD = 1 << 30


class RingBufReader:
    def __init__(self, map_fd: int, size: int):
        self.size = size
        self.mask = size - 1
        page = mmap.PAGESIZE
        self._cons = mmap.mmap(map_fd, page, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE, offset=0)
        # producer page, then the data area mapped twice so records never wrap
        self._prod = mmap.mmap(map_fd, page + 2 * size, mmap.MAP_SHARED, mmap.PROT_READ, offset=page)
        self._data = memoryview(self._prod)[page:]
        self._ep = select.epoll()
        self._ep.register(map_fd, select.EPOLLIN)

    def wait(self, timeout_ms: int, tick_ms: int = 10) -> None:
        """Until data is available or timeout_ms passes. Producers wake us only for a full
        batch (SL_WAKEUP_BYTES), so we also look every tick_ms."""
        deadline = time.monotonic() + timeout_ms / 1000
        while not self.available():
            left = deadline - time.monotonic()
            if left <= 0:
                return
            self._ep.poll(min(left, tick_ms / 1000))

    def available(self) -> bool:
        return _POS.unpack_from(self._cons, 0)[0] != _POS.unpack_from(self._prod, 0)[0]

    def positions(self) -> tuple[int, int]:
        """(consumer, producer) positions: records in [consumer, producer) are reserved, each
        either committed, discarded or still BUSY (the reader stops at the first busy one)."""
        return _POS.unpack_from(self._cons, 0)[0], _POS.unpack_from(self._prod, 0)[0]

    @property
    def data(self) -> memoryview:
        return self._data

    def commit(self, pos: int) -> None:
        _POS.pack_into(self._cons, 0, pos)

    def close(self) -> None:
        try:
            self._ep.close()
            self._data.release()
            self._prod.close()
            self._cons.close()
        except (BufferError, ValueError):
            pass
