"""Reading /proc (a target's maps, stat, status, tasks, root, memory; the process list) behind
one narrow class: nothing outside stacklens.introspect names a /proc path
(tests/unit/test_introspection_layer.py checks it; the in-target agent reads its own /proc/self).

The one /proc/PID/maps parser (`parse_maps`, `ProcFS.maps`) and the one /proc/PID/stat parser
(`ProcFS.stat`): the injector, the agent server, the daemon (discovery, sessions, doctor, held
programs) and the BPF side (library discovery and native symbolization in bpf/procmaps.py, the
Python-stack reader in pystacks/python_process.py) all read /proc through it.

No privilege beyond what /proc itself asks (reading another user's maps needs PTRACE_MODE_READ).
Tests pass a ``ProcFS(root=...)`` over a checked-in or generated tree.
"""

from __future__ import annotations

import errno
import os
import struct
from dataclasses import dataclass
from pathlib import Path

from stacklens.errors import InputError, NoSuchProcess, PermissionDenied, StacklensError

# x86-64 numbers of the syscalls a blocked thread is usually in (`ProcFS.thread_syscall`); the rest
# are shown as their number
SYSCALL_NAMES = {0: "read", 7: "poll", 23: "select", 35: "nanosleep", 43: "accept", 45: "recvfrom",
                 47: "recvmsg", 61: "wait4", 202: "futex", 230: "clock_nanosleep", 232: "epoll_wait",
                 270: "pselect6", 271: "ppoll", 281: "epoll_pwait", 288: "accept4", 441: "epoll_pwait2"}


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

    def __init__(self, root: Path | str | None = None) -> None:
        self.root = Path("/proc" if root is None else root)

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

    def open_mem(self, pid: int) -> int:
        """An O_RDONLY fd of /proc/PID/mem (the caller closes it): bound to the address space it
        was opened on, so once the target exits or execs reads fail, even if its PID is reused."""
        try:
            return os.open(self.root / str(pid) / "mem", os.O_RDONLY | os.O_CLOEXEC)
        except (FileNotFoundError, ProcessLookupError):
            raise NoSuchProcess(f"process {pid} does not exist (it may have exited)") from None
        except PermissionError:
            if os.geteuid() == 0:     # root already: the kernel guards this process
                raise PermissionDenied(
                    f"the kernel refuses root access to /proc/{pid}/mem: the process is protected (not "
                    "dumpable, a security module such as SELinux or a BPF LSM, or another PID/user "
                    "namespace): it cannot be read from here") from None
            raise PermissionDenied(
                f"cannot read /proc/{pid}/mem: run as root (or with CAP_SYS_PTRACE)") from None

    def exe(self, pid: int) -> str:
        """The target's executable ("" when unreadable: gone, a kernel thread, not ours)."""
        try:
            return os.readlink(self.root / str(pid) / "exe")
        except OSError:
            return ""

    def exe_strict(self, pid: int) -> str:
        """The target's executable; "" for a process without one (a kernel thread, a zombie).
        Raises NoSuchProcess / PermissionDenied."""
        try:
            return os.readlink(self.root / str(pid) / "exe")
        except FileNotFoundError:
            if not self.exists(pid):
                raise NoSuchProcess(f"no process with PID {pid}") from None
            return ""
        except PermissionError:
            raise PermissionDenied(
                f"cannot inspect PID {pid} (/proc/{pid}/exe): run stacklens as root with CAP_SYS_PTRACE "
                "(the target belongs to another user)") from None
        except OSError:
            return ""

    def auxv(self, pid: int) -> list[tuple[int, int]]:
        """/proc/PID/auxv as (key, value) pairs (AT_ENTRY: the program's entry point)."""
        try:
            data = (self.root / str(pid) / "auxv").read_bytes()
        except (FileNotFoundError, ProcessLookupError):
            raise NoSuchProcess(f"PID {pid} exited") from None
        except PermissionError:
            raise PermissionDenied(f"cannot read /proc/{pid}/auxv: run stacklens as root") from None
        return list(struct.iter_unpack("<QQ", data[: len(data) // 16 * 16]))

    def owner(self, pid: int) -> os.stat_result:
        """stat() of /proc/PID: its st_uid and st_gid are the target's (effective) user and group."""
        try:
            return os.stat(self.root / str(pid))
        except FileNotFoundError:
            raise NoSuchProcess(f"no process with PID {pid}: check the PID") from None

    def own_fd_path(self, fd: int) -> Path:
        """/proc/self/fd/FD: a path naming what one of the daemon's own descriptors names (what
        bind() needs to create a socket inside a directory held open by descriptor)."""
        return self.root / "self" / "fd" / str(fd)

    def root_dir(self, pid: int) -> Path:
        """/proc/PID/root: the target's root directory, as a path the daemon can open."""
        return self.root / str(pid) / "root"

    def in_own_root(self, pid: int) -> bool:
        """Whether the target sees the daemon's root as its own (no container, no chroot)."""
        try:
            st, mine = os.stat(self.root_dir(pid)), os.stat("/")
        except FileNotFoundError:
            raise NoSuchProcess(f"no process with PID {pid}") from None
        return st.st_ino == mine.st_ino and st.st_dev == mine.st_dev

    def host_tids(self, pid: int) -> dict[int, int]:
        """Thread id in the target's PID namespace (what gettid() told it) -> host tid, from the
        last NSpid of each /proc/PID/task/TID/status; {} when the task list is unreadable."""
        out: dict[int, int] = {}
        try:
            tasks = os.listdir(self.root / str(pid) / "task")
        except OSError:
            return out
        for t in tasks:
            try:
                text = (self.root / str(pid) / "task" / t / "status").read_text()
            except OSError:
                continue
            for line in text.splitlines():
                if line.startswith("NSpid:"):
                    out[int(line.split()[-1])] = int(t)
        return out

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

    def stat(self, pid: int, tid: int | None = None) -> tuple[str, list[str]]:
        """/proc/PID/stat (task/TID/stat with ``tid``) as (comm, the fields after it): fields[0] is
        the state, [6] the flags, [11] and [12] utime and stime, [19] the start time. The comm is
        the target's to choose (')' and spaces included): it ends at the last ')'."""
        text = self.read(pid, "stat" if tid is None else f"task/{tid}/stat")
        comm, _, rest = text.rpartition(")")
        return comm.partition("(")[2], rest.split()

    def state(self, pid: int) -> str:
        """The process's state letter (R, S, D, T, Z, X, …)."""
        return self.stat(pid)[1][0]

    def cpu_time_ns(self, pid: int) -> int:
        """utime + stime of the whole process (every thread, live or exited) in ns."""
        fields = self.stat(pid)[1]
        return (int(fields[11]) + int(fields[12])) * 1_000_000_000 // os.sysconf("SC_CLK_TCK")

    def fdinfo(self, pid: int, fd: int) -> dict[str, str]:
        """/proc/PID/fdinfo/FD as key -> value (a BPF program's `run_time_ns`, `run_cnt`, …)."""
        out = {}
        for line in self._read(pid, f"fdinfo/{fd}").splitlines():
            k, _, v = line.partition(":")
            out[k.strip()] = v.strip()
        return out

    def fd_path(self, pid: int, fd: int) -> str:
        """The path that names the process's open file `fd` (/proc/PID/fd/FD: a memfd's too)."""
        return str(self.root / str(pid) / "fd" / str(fd))

    def starttime(self, pid: int) -> int:
        return int(self.stat(pid)[1][19])

    def thread_comm(self, pid: int, tid: int) -> str:
        """/proc/PID/task/TID/comm: the thread's name (``prctl(PR_SET_NAME)``, 15 bytes at most)."""
        return self._read(pid, f"task/{tid}/comm").strip()

    def thread_state(self, pid: int, tid: int) -> str:
        return self.stat(pid, tid)[1][0]

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

    def environ(self, pid: int) -> bytes | None:
        """The target's *initial* environment, NUL-separated (None: unreadable)."""
        try:
            return (self.root / str(pid) / "environ").read_bytes()
        except OSError:
            return None

    def environ_has(self, pid: int, name: str) -> bool | None:
        """Whether the target's *initial* environment sets NAME (None: unreadable)."""
        data = self.environ(pid)
        if data is None:
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

    def mapped_file_candidates(self, pid: int, m: Mapping) -> list[str]:
        """Where to open the file behind a mapping from here, most exact first. /proc/PID/maps
        prints paths relative to *our* root when the file is reachable from it (a chroot shows the
        host path) and relative to the target's mount namespace otherwise (a container), so: the
        exact mapped file (map_files, root only), the path under the target's root, the path as
        printed (the last two not for a deleted file: another file may have its name now)."""
        out = [str(self.root / str(pid) / "map_files" / f"{m.start:x}-{m.end:x}")]
        if not m.path.endswith(" (deleted)"):
            out += [str(self.target_path(pid, m.path)), m.path]
        return out

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


PID_MAX = 2**31 - 1     # the kernel's pid_t and the gRPC int32 field; pid_max itself is at most 2**22


def check_pid_range(pid: int) -> None:
    """InputError unless `pid` is a number a process id can be (1..PID_MAX); no I/O, so it fits a
    PID given by a user wherever the process may be (the CLI's client, the daemon's service)."""
    if not isinstance(pid, int) or not 1 <= pid <= PID_MAX:
        raise InputError(f"invalid PID {pid}: a process id is an integer in 1..{PID_MAX} (see `stacklens ps`)")


def check_pid(pid: int) -> None:
    """The one PID check: raise unless `pid` is a live, non-zombie process we may signal."""
    if not isinstance(pid, int) or pid <= 0:
        raise InputError(f"PID must be a positive integer, got {pid!r}")
    try:
        os.kill(pid, 0)
    except ProcessLookupError as e:
        raise NoSuchProcess(f"no process {pid}; check the PID with `ps`") from e
    except PermissionError as e:
        raise PermissionDenied(f"not allowed to signal process {pid}; run stacklens as root") from e
    try:
        state = ProcFS().state(pid)
    except NoSuchProcess as e:
        raise NoSuchProcess(f"no process {pid}; check the PID with `ps`") from e
    if state == "Z":
        raise NoSuchProcess(f"process {pid} has exited (zombie); nothing to attach to")


def pid_alive(pid: int) -> bool:
    """Whether `pid` still runs (a zombie has exited as far as profiling goes); a process we may
    not signal is alive."""
    try:
        check_pid(pid)
    except PermissionDenied:
        return True
    except (StacklensError, OSError):
        return False
    return True
