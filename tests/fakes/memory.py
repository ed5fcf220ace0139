"""A `ProcessMemory` in local memory for unit tests: ``FakeMemory({addr: bytes, ...})``."""

from __future__ import annotations

from stacklens.errors import MemoryReadError


class FakeMemory:
    """Sparse regions; a read or write outside them raises MemoryReadError (as a real target's
    unmapped page does). Writes are recorded in ``writes``."""

    def __init__(self, regions: dict[int, bytes | bytearray] | None = None) -> None:
        self.regions = {a: bytearray(b) for a, b in (regions or {}).items()}
        self.writes: list[tuple[int, bytes]] = []

    def _find(self, addr: int, n: int) -> tuple[bytearray, int]:
        for base, buf in self.regions.items():
            if base <= addr and addr + n <= base + len(buf):
                return buf, addr - base
        raise MemoryReadError(f"fake memory: {addr:#x}+{n} unmapped")

    def read(self, addr: int, n: int) -> bytes:
        buf, off = self._find(addr, n)
        return bytes(buf[off:off + n])

    def write(self, addr: int, data: bytes) -> None:
        buf, off = self._find(addr, len(data))
        buf[off:off + len(data)] = data
        self.writes.append((addr, bytes(data)))
