"""One agent server's files in its agent directory: its PID lock, the agent's code, its socket.

Runs as root. The directory is opened once (``agentdir.open_socket_dir``: the daemon's, not
writable by others) and every file below is made, changed and removed relative to that
descriptor, never by a path through the target's root (a symlink there would lead the daemon
anywhere on the host: ``inject/rootpath.py``). The socket is mode 0600, or 0660 with the target's
group when the target is not root; the agent's code is the daemon's, 0755 folders and 0644 files
the target can read and not write. Its PID lock is taken, and its files removed, under the
directory's flock (``agentdir.py`` says why). A few syscalls a file, once per server.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

from stacklens.errors import AttachError, InputError
from stacklens.inject.channel.agentdir import (clean_stale, default_socket_dir, dir_lock, open_socket_dir, remove_files,
                                               take_pid_lock)
from stacklens.inject.rootpath import remove_tree
from stacklens.introspect.procfs import ProcFS

AGENT_PACKAGES = ("gpu",)   # folders of the agent's sources copied with it (one level, *.py only)


class ServerFiles:
    """Made for ``pid`` in ``socket_dir`` (None: its default, inside the target's root when it has
    its own), with the agent's sources copied from ``agent_src``; ``listener`` is the socket,
    bound, not yet listening. ``cleaned``: stale files of dead servers swept on the way."""

    def __init__(self, pid: int, socket_dir: Path | str | None, agent_src: Path) -> None:
        self.pid = pid
        self.dir = Path(socket_dir) if socket_dir is not None else default_socket_dir(pid)
        tstat = ProcFS().owner(pid)             # NoSuchProcess when it is gone
        self.dirfd, target_dir = open_socket_dir(pid, self.dir, tstat)
        self.codefd = -1
        self.lock_fd = -1
        try:
            with dir_lock(self.dirfd, str(self.dir)):
                self.lock_fd = take_pid_lock(self.dirfd, pid)
                self.cleaned = clean_stale(self.dirfd, keep=pid)
            self._sock_name = f"agent-{pid}.sock"
            self._code_name = f"agent-{pid}-code"
            self.path = str(self.dir / self._sock_name)
            self.target_path = f"{target_dir}/{self._sock_name}"
            self.agent_dir = self.dir / self._code_name
            self.target_agent_dir = f"{target_dir}/{self._code_name}"
            self._install_agent(agent_src)
            self.listener = self._bind(tstat)
        except BaseException:
            if self.lock_fd >= 0:
                self.remove()
            self.close()
            raise

    def _install_agent(self, src: Path) -> None:
        """Copy the agent sources to a directory the target can read and not write."""
        remove_tree(self.dirfd, self._code_name)
        os.mkdir(self._code_name, 0o755, dir_fd=self.dirfd)
        self.codefd = os.open(self._code_name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC,
                              dir_fd=self.dirfd)
        os.fchmod(self.codefd, 0o755)
        for f in sorted(src.glob("*.py")):
            self.write_agent_file(f.name, f.read_bytes())
        for sub in AGENT_PACKAGES:          # one level of folders: the GPU collectors (gpu/)
            os.mkdir(sub, 0o755, dir_fd=self.codefd)
            subfd = os.open(sub, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=self.codefd)
            try:
                os.fchmod(subfd, 0o755)
                for f in sorted((src / sub).glob("*.py")):
                    _write_file(subfd, f.name, f.read_bytes())
            finally:
                os.close(subfd)

    def _bind(self, tstat: os.stat_result) -> socket.socket:
        try:
            os.unlink(self._sock_name, dir_fd=self.dirfd)
        except FileNotFoundError:
            pass
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        old = os.umask(0o177)
        try:
            # bind() takes a path: the directory's descriptor as /proc/self/fd/N, so the
            # socket lands in the directory opened above whatever its path names now
            listener.bind(f"{ProcFS().own_fd_path(self.dirfd)}/{self._sock_name}")
        finally:
            os.umask(old)
        if tstat.st_uid != 0:
            os.chown(self._sock_name, 0 if os.geteuid() == 0 else -1, tstat.st_gid, dir_fd=self.dirfd,
                     follow_symlinks=False)
            os.chmod(self._sock_name, 0o660, dir_fd=self.dirfd)   # our directory: no symlink there
        return listener

    def write_agent_file(self, name: str, data: bytes) -> str:
        """Write ``name`` (mode 0644, the daemon's) into the agent's code directory; returns its
        path as the target sees it."""
        _write_file(self.codefd, name, data)
        return f"{self.target_agent_dir}/{name}"

    def remove(self) -> None:
        """Our socket, code and lock, removed under the directory's flock while our lock is still
        held (a server for this PID starting now finds either all of them or none). Where the
        flock cannot be had they stay: once our lock is closed, any later sweep removes them."""
        try:
            with dir_lock(self.dirfd, str(self.dir)):
                remove_files(self.dirfd, self.pid)
        except (AttachError, OSError):
            pass

    def close(self) -> None:
        """The descriptors: the code directory's, the lock's (which frees the PID), the directory's."""
        for fd in (self.codefd, self.lock_fd, self.dirfd):
            if fd >= 0:
                os.close(fd)


def _write_file(dirfd: int, name: str, data: bytes) -> None:
    if "/" in name or name in ("", ".", ".."):
        raise InputError(f"bad agent file name {name!r}")
    fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644, dir_fd=dirfd)
    with os.fdopen(fd, "wb") as f:
        os.fchmod(fd, 0o644)
        f.write(data)


__all__ = ["AGENT_PACKAGES", "ServerFiles"]
