"""Reading /proc (a target's maps, status, tasks; the process list) behind one narrow class.

The one /proc/PID/maps parser (`parse_maps`, `ProcFS.maps`): the injector, the daemon's discovery
and the BPF side (library discovery and native symbolization in bpf/procmaps.py, the Python-stack
reader in bpf/python_process.py) all read maps through it.

No privilege beyond what /proc itself asks (reading another user's maps needs PTRACE_MODE_READ).
Tests pass a ``ProcFS(root=...)`` over a checked-in or generated tree.
"""

from __future__ import annotations

import errno
import os
from dataclasses import dataclass
from pathlib import Path

from stacklens.errors import NoSuchProcess, PermissionDenied


@dataclass(frozen=True)
class Mapping:
    start: int
    end: int
    perms: str
    offset: int
    inode: int
    path: str  # "" for anonymous mappings; "[vdso]", "[stack]" …; " (deleted)" suffix kept
    dev: str = ""  # "major:minor" (hex) of the file's device; with inode, what identifies the file

    @property
    def size(self) -> int:
        return self.end - self.start


def parse_maps(text: str) -> list[Mapping]:
    out = []
    for line in text.splitlines():
        parts = line.split(None, 5)
        if len(parts) < 5:
            continue
        lo, hi = parts[0].split("-")
        out.append(
            Mapping(int(lo, 16), int(hi, 16), parts[1], int(parts[2], 16), int(parts[4]),
                    parts[5].strip() if len(parts) > 5 else "", parts[3])
        )
    return out


class ProcFS:
    """The /proc of the daemon's PID namespace (``root`` is a parameter so tests can fake it)."""

    def __init__(self, root: Path | str = "/proc") -> None:
        self.root = Path(root)

    def _read(self, pid: int, name: str) -> str:
        try:
            return (self.root / str(pid) / name).read_text(errors="replace")
        except FileNotFoundError:
            raise NoSuchProcess(f"no process with PID {pid}: check the PID (`ps -p {pid}`)") from None
        except ProcessLookupError:
            raise NoSuchProcess(f"PID {pid} exited") from None
        except PermissionError:
            raise PermissionDenied(
                f"cannot read /proc/{pid}/{name}: run stacklens as root or with CAP_SYS_PTRACE"
            ) from None

    def pids(self) -> list[int]:
        return sorted(int(p.name) for p in self.root.iterdir() if p.name.isdigit())

    def read(self, pid: int, name: str) -> str:
        return self._read(pid, name)

    def exe(self, pid: int) -> str:
        try:
            return os.readlink(self.root / str(pid) / "exe")
        except OSError:
            return ""

    def exists(self, pid: int) -> bool:
        return (self.root / str(pid)).is_dir()

    def maps(self, pid: int) -> list[Mapping]:
        return parse_maps(self._read(pid, "maps"))

    def status(self, pid: int) -> dict[str, str]:
        out = {}
        for line in self._read(pid, "status").splitlines():
            k, _, v = line.partition(":")
            out[k.strip()] = v.strip()
        return out

    def comm(self, pid: int) -> str:
        return self._read(pid, "comm").strip()

    def starttime(self, pid: int) -> int:
        stat = self._read(pid, "stat")
        return int(stat[stat.rindex(")") + 2:].split()[19])

    def thread_comm(self, pid: int, tid: int) -> str:
        """/proc/PID/task/TID/comm: the thread's name (``prctl(PR_SET_NAME)``, 15 bytes at most)."""
        return self._read(pid, f"task/{tid}/comm").strip()

    def thread_state(self, pid: int, tid: int) -> str:
        stat = self._read(pid, f"task/{tid}/stat")
        return stat[stat.rindex(")") + 2:].split()[0]

    def thread_syscall(self, pid: int, tid: int) -> str:
        """First word of /proc/PID/task/TID/syscall: a syscall number, "running" or "-1"."""
        try:
            return self._read(pid, f"task/{tid}/syscall").split()[0]
        except (PermissionDenied, IndexError):
            return "?"

    def tasks(self, pid: int) -> list[int]:
        try:
            return sorted(int(t) for t in os.listdir(self.root / str(pid) / "task"))
        except FileNotFoundError:
            raise NoSuchProcess(f"no process with PID {pid}") from None

    def environ_has(self, pid: int, name: str) -> bool | None:
        """Whether the target's *initial* environment sets NAME (None: unreadable)."""
        try:
            data = (self.root / str(pid) / "environ").read_bytes()
        except OSError:
            return None
        return any(e.split(b"=", 1)[0] == name.encode() for e in data.split(b"\0") if e)

    def cmdline(self, pid: int) -> list[str]:
        try:
            data = (self.root / str(pid) / "cmdline").read_bytes()
        except OSError:
            return []
        return [a.decode(errors="replace") for a in data.split(b"\0") if a]

    def yama_ptrace_scope(self) -> int | None:
        try:
            return int((self.root / "sys/kernel/yama/ptrace_scope").read_text().strip())
        except (OSError, ValueError):
            return None

    def target_path(self, pid: int, path: str) -> Path:
        """A path as the target sees it, opened from the daemon (containers: /proc/PID/root)."""
        return self.root / str(pid) / "root" / path.lstrip("/")

    def open_mapped_file(self, pid: int, m: Mapping) -> Path:
        """The file behind a mapping: via the target's root, else map_files (needs CAP_SYS_ADMIN)."""
        path = m.path.removesuffix(" (deleted)")
        p = self.target_path(pid, path)
        if os.path.exists(p) and not m.path.endswith(" (deleted)"):
            return p
        alt = self.root / str(pid) / "map_files" / f"{m.start:x}-{m.end:x}"
        if os.path.exists(alt):
            return alt
        raise NoSuchProcess(f"cannot open {path} of PID {pid} ({errno.errorcode.get(errno.ENOENT)})")
