"""Directories inside a target's root (container, chroot), opened from the daemon within that root.

Runs as root. ``/proc/PID/root/tmp`` opened by path follows a symlink the target planted: an
absolute one (``/tmp -> /etc``) resolves against the *daemon's* root, so the daemon would create
its agent directory, lock, socket and agent code in any host directory the target names (issue 17).
Here the target's root is held as a file descriptor and paths below it are resolved with
``openat2(RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS)`` (Linux 5.6+): ``..`` and absolute symlinks stay
inside that root, exactly as the target itself resolves them, so what is created lands where the
target looks for it. Without openat2 (ENOSYS) a symlink anywhere on the path is refused
(``O_NOFOLLOW`` walk). Everything after that is relative to the returned directory descriptor.
Cost: one syscall per path component at attach time.
"""

from __future__ import annotations

import ctypes
import errno
import os
import stat

from stacklens.errors import AttachError
from stacklens.introspect.procfs import ProcFS

SYS_OPENAT2 = 437                    # x86-64 and aarch64 (asm-generic) alike
RESOLVE_NO_MAGICLINKS = 0x02
RESOLVE_IN_ROOT = 0x10


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


def openat2(dirfd: int, path: str, flags: int, resolve: int) -> int:
    """The openat2(2) syscall; raises OSError (ENOSYS on kernels before 5.6)."""
    how = _OpenHow(flags | os.O_CLOEXEC, 0, resolve)
    fd = _libc.syscall(ctypes.c_long(SYS_OPENAT2), ctypes.c_int(dirfd), ctypes.c_char_p(os.fsencode(path)),
                       ctypes.byref(how), ctypes.c_size_t(ctypes.sizeof(how)))
    if fd < 0:
        e = ctypes.get_errno()
        raise OSError(e, f"openat2({path!r}): {os.strerror(e)}")
    return fd


def _walk_nofollow(rootfd: int, path: str) -> int:
    """openat2's fallback: each component opened with O_NOFOLLOW (a symlink is an error)."""
    fd = os.dup(rootfd)
    try:
        for part in [p for p in path.split("/") if p and p != "."]:
            if part == "..":
                raise OSError(errno.EPERM, f"'..' in {path!r}")
            nxt = os.open(part, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
            os.close(fd)
            fd = nxt
        return fd
    except BaseException:
        os.close(fd)
        raise


def open_in_root(pid: int, path: str, procfs: ProcFS | None = None) -> int:
    """An O_PATH descriptor of the directory ``path`` as PID ``pid`` sees it (resolved inside its
    root). Raises AttachError naming the path and what to do."""
    try:
        rootfd = os.open((procfs or ProcFS()).root_dir(pid), os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as e:
        raise AttachError(f"cannot open the root directory of PID {pid} ({e.strerror}): "
                          "is it still running? (`stacklens ps`)") from None
    try:
        try:
            return openat2(rootfd, path.lstrip("/") or ".", os.O_PATH | os.O_DIRECTORY,
                           RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS)
        except OSError as e:
            if e.errno != errno.ENOSYS:
                raise
        return _walk_nofollow(rootfd, path)
    except OSError as e:
        raise AttachError(f"cannot open {path} inside the root of PID {pid} ({e.strerror}; resolved within "
                          "the target's own root, a symlink there that leads nowhere inside it fails): "
                          f"give the daemon a socket directory the target can reach, or fix {path} in "
                          "the container") from None
    finally:
        os.close(rootfd)


def writable_by(st: os.stat_result, uid: int, gid: int) -> bool:
    """Whether a process of uid/gid (its primary group only) may create entries in a directory."""
    mode = st.st_mode
    if uid == 0:
        return True
    if st.st_uid == uid:
        return bool(mode & stat.S_IWUSR)
    if st.st_gid == gid:
        return bool(mode & stat.S_IWGRP)
    return bool(mode & stat.S_IWOTH)


def private_subdir(parent_fd: int, name: str, mode: int = 0o711) -> int:
    """Create (if needed) and open ``name`` under ``parent_fd``: a real directory (no symlink
    followed), owned by the daemon's uid, not writable by group or others. Returns an O_RDONLY
    directory descriptor; raises AttachError with the fix."""
    try:
        os.mkdir(name, mode, dir_fd=parent_fd)
    except FileExistsError:
        pass
    try:
        fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=parent_fd)
    except OSError as e:
        raise AttachError(f"agent directory {name} is not a directory ({e.strerror}; a symlink is refused): "
                          "remove it") from None
    st = os.fstat(fd)
    if st.st_uid != os.geteuid() or st.st_mode & 0o022:
        os.close(fd)
        raise AttachError(f"agent directory {name} must be owned by uid {os.geteuid()} and not writable by "
                          f"group/others (it is uid {st.st_uid}, mode {st.st_mode & 0o7777:o}): fix or remove it")
    os.fchmod(fd, mode)
    return fd


def remove_tree(parent_fd: int, name: str) -> None:
    """``rm -r name`` below ``parent_fd`` without following a symlink; a missing name is fine."""
    try:
        st = os.stat(name, dir_fd=parent_fd, follow_symlinks=False)
    except FileNotFoundError:
        return
    if not stat.S_ISDIR(st.st_mode):
        os.unlink(name, dir_fd=parent_fd)
        return
    fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=parent_fd)
    try:
        for entry in os.listdir(fd):
            remove_tree(fd, entry)
    finally:
        os.close(fd)
    os.rmdir(name, dir_fd=parent_fd)


__all__ = ["open_in_root", "openat2", "private_subdir", "remove_tree", "writable_by"]
