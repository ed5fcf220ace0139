"""The agent directories: where a server's socket, lock and code live, locked against other servers.

Runs as root. Files of a server in its directory: ``agent-PID.lock`` (flocked while the server
lives), ``agent-PID.sock``, ``agent-PID-code/`` (the agent's sources and its bootstrap, which holds
the token). Any number of servers share a directory, in one daemon or several (issue 26): a server
takes its PID's lock, and judges and removes stale files of other PIDs (a killed daemon's: their
lock not held, or gone), only while it holds the directory's own flock (``dir_lock``); it removes
its own files under that flock too. So to every other server a lock file is created and locked in
one step, and one whose flock can be taken belongs to no live server. The flock is held for a few
syscalls (a stale sweep: an unlink per file); ``clean_stale_files`` sweeps every agent directory at
the daemon's start.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import time
from pathlib import Path

from stacklens.errors import AlreadyAttached, AttachError, StacklensError
from stacklens.inject.rootpath import open_in_root, private_subdir, remove_tree, writable_by
from stacklens.introspect.procfs import ProcFS

_ENTRY = re.compile(r"agent-(\d+)(?:\.lock|\.sock|-code)")
HOST_AGENT_DIR = Path("/run/stacklens/agents")
CONTAINER_AGENT_DIR = "/tmp/.stacklens-agents"     # inside a target's root (container, chroot)
# Longest wait for an agent directory's flock; it is held for a few syscalls, so only a process
# stopped while holding it (SIGSTOP, a debugger) makes an attach wait this long.
DIR_LOCK_WAIT_S = 30.0


def open_socket_dir(pid: int, d: Path, tstat: os.stat_result) -> tuple[int, str]:
    """The socket directory ``d`` opened (created if needed: a real directory of the daemon's uid,
    not group/world-writable), and its path as the target sees it. A path inside the target's
    root (``/proc/PID/root/...``) is resolved within that root (rootpath.py), and only where the
    target's own user could create it: the daemon writes nothing into a target's namespace that
    the target could not have written itself."""
    if str(d).startswith(f"{ProcFS().root_dir(pid)}/"):
        in_target = target_view(d, pid)
        parent_fd = open_in_root(pid, os.path.dirname(in_target))
        try:
            pst = os.fstat(parent_fd)
            if not writable_by(pst, tstat.st_uid, tstat.st_gid):
                raise AttachError(
                    f"PID {pid}'s {os.path.dirname(in_target)} (inside its root: uid {pst.st_uid}, mode "
                    f"{pst.st_mode & 0o7777:o}) is not writable by the target's user (uid {tstat.st_uid}): "
                    "stacklens creates its agent socket inside a container only where the target itself "
                    "could; give the container a writable /tmp")
            return private_subdir(parent_fd, os.path.basename(in_target)), in_target
        finally:
            os.close(parent_fd)
    os.makedirs(d.parent, exist_ok=True)        # a host path the daemon's caller chose
    parent_fd = os.open(d.parent, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        return private_subdir(parent_fd, d.name), str(d)
    finally:
        os.close(parent_fd)


def default_socket_dir(pid: int, procfs: ProcFS | None = None) -> Path:
    """Where the target can reach us: /run/stacklens/agents, or inside the target's root if it
    lives in another mount namespace (container, chroot)."""
    procfs = procfs or ProcFS()
    if procfs.in_own_root(pid):
        return HOST_AGENT_DIR
    return procfs.root_dir(pid) / CONTAINER_AGENT_DIR.lstrip("/")


def target_view(path: Path | str, pid: int) -> str:
    """The path as the target sees it (strip /proc/PID/root)."""
    s = str(path)
    prefix = str(ProcFS().root_dir(pid))
    if s.startswith(prefix + "/"):
        return s[len(prefix):]
    return s


@contextlib.contextmanager
def dir_lock(dirfd: int, name: str):
    """The agent directory's flock, taken on its descriptor (a directory has no file to lose):
    one open file description each server, so servers of one process exclude each other too."""
    deadline = time.monotonic() + DIR_LOCK_WAIT_S
    while True:
        try:
            fcntl.flock(dirfd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            if time.monotonic() > deadline:
                raise AttachError(f"agent directory {name} stayed locked for {DIR_LOCK_WAIT_S:.0f} s: a stacklens "
                                  "process holding it is stopped or hung (`fuser -v` on it names it); "
                                  "continue or end it, then attach again") from None
            time.sleep(0.002)
    try:
        yield
    finally:
        fcntl.flock(dirfd, fcntl.LOCK_UN)


def take_pid_lock(dirfd: int, pid: int) -> int:
    """``agent-PID.lock`` opened (created if needed) and flocked; the caller holds the directory's
    flock, so nobody else is between those two steps. Raises AlreadyAttached while a live server
    holds it."""
    fd = os.open(f"agent-{pid}.lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dirfd)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise AlreadyAttached(f"another stacklens session already serves PID {pid}; "
                              f"detach it first (`stacklens detach {pid}`)") from None
    except BaseException:
        os.close(fd)
        raise
    return fd


def remove_files(dirfd: int, pid: int) -> None:
    """A server's socket, code directory and lock file (in that order: the lock goes last)."""
    for remove in (lambda: os.unlink(f"agent-{pid}.sock", dir_fd=dirfd),
                   lambda: remove_tree(dirfd, f"agent-{pid}-code"),
                   lambda: os.unlink(f"agent-{pid}.lock", dir_fd=dirfd)):
        try:
            remove()
        except FileNotFoundError:
            pass


def clean_stale(dirfd: int, keep: int | None = None) -> int:
    """Remove the files of every PID but ``keep`` whose server is gone (its daemon was killed):
    its lock file can be flocked, or there is none. The caller holds the directory's flock, under
    which live servers create their lock and remove their files: a live server's lock is always
    there and held. Returns how many PIDs' files were removed."""
    try:
        names = os.listdir(dirfd)
    except OSError:
        return 0
    pids = {int(m.group(1)) for m in map(_ENTRY.fullmatch, names) if m} - {keep}
    cleaned = 0
    for p in sorted(pids):
        lfd = -1
        try:
            lfd = os.open(f"agent-{p}.lock", os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dirfd)
            fcntl.flock(lfd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except FileNotFoundError:
            pass                                    # no lock: nobody serves that PID
        except OSError:                             # held (a live server) or not ours to judge
            if lfd >= 0:
                os.close(lfd)
            continue
        try:
            remove_files(dirfd, p)
            cleaned += 1
        except OSError:
            pass
        finally:
            if lfd >= 0:
                os.close(lfd)
    return cleaned


def _open_existing_dir(name: str, parent_fd: int | None = None) -> int:
    """``name`` (under ``parent_fd``) opened if it is an agent directory of ours (a real directory,
    our uid, not group/world-writable); -1 otherwise. Creates nothing."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=parent_fd)
    except OSError:
        return -1
    st = os.fstat(fd)
    if st.st_uid != os.geteuid() or st.st_mode & 0o022:
        os.close(fd)
        return -1
    return fd


def _agent_dirs(procfs: ProcFS):
    """Descriptors of the agent directories that exist: the host's, then one per distinct root of
    the running processes (a container's /tmp/.stacklens-agents, resolved inside its root)."""
    seen: set[tuple[int, int]] = set()
    fd = _open_existing_dir(str(HOST_AGENT_DIR))
    if fd >= 0:
        st = os.fstat(fd)
        seen.add((st.st_dev, st.st_ino))
        yield fd
    roots: set[tuple[int, int]] = set()
    for pid in procfs.pids():
        try:
            if procfs.in_own_root(pid):
                continue
            st = os.stat(procfs.root_dir(pid))
        except (OSError, StacklensError):
            continue                                # exited, or a root we may not look into
        if (st.st_dev, st.st_ino) in roots:
            continue
        roots.add((st.st_dev, st.st_ino))
        try:
            parent = open_in_root(pid, os.path.dirname(CONTAINER_AGENT_DIR), procfs)
        except (AttachError, OSError):
            continue
        try:
            fd = _open_existing_dir(os.path.basename(CONTAINER_AGENT_DIR), parent)
        finally:
            os.close(parent)
        if fd < 0:
            continue
        st = os.fstat(fd)
        if (st.st_dev, st.st_ino) in seen:
            os.close(fd)
            continue
        seen.add((st.st_dev, st.st_ino))
        yield fd


def clean_stale_files(procfs: ProcFS | None = None) -> int:
    """What killed daemons left in every agent directory (locks, sockets, code directories with
    their bootstrap token), removed; the files of live servers, of this daemon or any other, are
    kept. Called at the daemon's start. Returns how many PIDs' files were removed. Cost: a stat
    per process, an openat2 per distinct container root, an unlink per stale file."""
    cleaned = 0
    for fd in _agent_dirs(procfs or ProcFS()):
        try:
            with dir_lock(fd, "(start-up sweep)"):
                cleaned += clean_stale(fd)
        except AttachError:
            pass                                    # held by a stopped process: the next attach cleans it
        finally:
            os.close(fd)
    return cleaned



__all__ = ["CONTAINER_AGENT_DIR", "HOST_AGENT_DIR", "clean_stale_files", "clean_stale", "default_socket_dir",
           "dir_lock", "open_socket_dir", "remove_files", "take_pid_lock", "target_view"]
