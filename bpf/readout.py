"""What a loaded program holds for one process, read from user space: the ring decoder's view
of its maps (`BpfMaps`, bpf/decode.py DecodeMaps), and this process's operator-path call counts
and return-probed calls still in flight (`ProgramReadout`).

The maps are the shared program's (bpf/shared.py): one process's entries are told apart by pid
(op paths by owner, each asked once). Requires the program's map fds (root). A read of the op
counts walks the mmapped op_slots array and the op_counts overflow map, one syscall an entry
there; the in-flight calls, the `pending` map.
"""

from __future__ import annotations

import ctypes as ct

from stacklens.bpf.shared import SharedProgram


class BpfMaps:
    """The decoder's view of a loaded program's maps (bpf/decode.py DecodeMaps)."""

    def __init__(self, bpf, python_stacks: bool):
        self._bpf = bpf
        self._py_table = bpf[b"sl_py_stacks"] if python_stacks else None

    def walk_stack(self, table: bytes, key: int):
        return self._bpf[table].walk(key)

    def op_path(self, h: int) -> tuple[int, ...]:
        table = self._bpf[b"op_paths"]
        p = table[table.Key(h)]
        return tuple(p.ops[:p.depth])

    def py_stack(self, pyid: int) -> bytes:
        table = self._py_table
        return bytes(table[table.Key(pyid)])


class ProgramReadout:
    """One process's entries in a shared program's maps."""

    def __init__(self, pid: int):
        self.pid = pid
        self._op_own: dict[int, bool] = {}   # op-path hash -> it is this process's (shared maps)

    def op_hash_counts(self, shared: SharedProgram) -> list[tuple[int, int]]:
        """(path hash, calls) of this process's paths: the mmapped op_slots array, then the
        op_counts overflow map (both the shared program's: paths are told apart by owner)."""
        slots = shared.op_slots_view()
        hashes, counts = slots[0::2], slots[1::2]
        out = [(h, n) for h, n in zip(hashes, counts) if h and n]
        out += [(k.value, v.value) for k, v in shared.bpf[b"op_counts"].items()]
        return [(h, n) for h, n in out if self._own_path(shared.bpf, h)]

    def _own_path(self, bpf, h: int) -> bool:
        own = self._op_own.get(h)
        if own is None:
            table = bpf[b"op_paths"]
            try:
                own = table[table.Key(h)].tgid == self.pid
            except KeyError:
                return False          # not named yet (or the map was full): asked again later
            self._op_own[h] = own
        return own

    def pending_records(self, bpf) -> list[bytes] | None:
        """The raw entry events of this process's return-probed calls not yet returned (the
        shared program's `pending` map); None when it cannot be read."""
        records = []
        try:
            for _key, val in bpf["pending"].items():
                if val.pid == self.pid:       # the pending map is the shared program's
                    records.append(ct.string_at(ct.addressof(val), ct.sizeof(val)))
        except (KeyError, OSError):
            return None
        return records
