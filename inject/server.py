"""Daemon side of the agent channel: a Unix socket per target, strict parsing into records.

Runs as root. The socket lives in a root-owned directory that is not writable by others (mode
0600, or 0660 with the target's group when the target is not root), and only a peer whose
SO_PEERCRED pid is the target is served. Everything the agent sends is treated as hostile:
bounded frame size, strict types and ranges per message kind, unknown kinds rejected; every
rejection is counted (``stats()``) and the server keeps running. Nothing received is executed.
Strings are escaped (control characters, ``textsafe.py``) and frame strings cut to a length
(``validate.MAX_FRAME_FILE`` / ``MAX_FRAME_NAME``, counted ``truncated_strings``).
One reader thread per server; records wait in a deque bounded by count and by estimated bytes
(``MAX_QUEUED_BYTES``; drops counted ``dropped_records`` / ``dropped_bytes``) until ``poll()``.

Files of a server in its directory: ``agent-PID.lock`` (flocked while the server lives),
``agent-PID.sock``, ``agent-PID-code/`` (the agent's sources and its bootstrap, which holds the
token). Any number of servers share a directory, in one daemon or several (issue 26): a server takes
its PID's lock, and judges and removes stale files of other PIDs (a killed daemon's: their lock not
held, or gone), only while it holds the directory's own flock (``_dir_lock``); it removes its own
files under that flock too. So to every other server a lock file is created and locked in one step,
and one whose flock can be taken belongs to no live server. The flock is held for a few syscalls
(a stale sweep: an unlink per file); ``clean_stale_files`` sweeps every agent directory at the
daemon's start.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import fcntl
import json
import os
import re
import secrets
import socket
import struct
import threading
import time
from pathlib import Path

from stacklens.errors import AlreadyAttached, AttachError, InputError, StacklensError
from stacklens.introspect.procfs import ProcFS
from stacklens.inject.agent import wire
from stacklens.inject.gpu.cupti import MAX_BLOCK, NameReader, parse_layout, parse_raw
from stacklens.inject.gpu.rows import API_DOMAINS, MEMCPY_KINDS, ROW_KINDS, SYNC_TYPES, parse_rows
from stacklens.inject.inductor import parse_inductor
from stacklens.inject.rootpath import open_in_root, private_subdir, remove_tree, writable_by
from stacklens.records.agent import AgentHello, AgentStats, CompileRecord, HloKernel, HloMapRecord, Note, PySample
from stacklens.textsafe import safe_text
from stacklens.inject.validate import MAX_BATCH, MAX_FRAME_FILE, MAX_FRAME_NAME, MAX_INT, MAX_STR, ProtocolError
from stacklens.inject.validate import check_int as _int, check_list as _list, check_num as _num, check_row as _row
from stacklens.inject.validate import check_text as _str, clip_text

AGENT_SRC = Path(__file__).parent / "agent"
AGENT_PACKAGES = ("gpu",)   # folders of AGENT_SRC copied with it (one level, *.py only)
LEVELS = ("info", "warning", "error")
MAX_HLO_PARTS = 4096
MAX_HLO_OPS = 64
# string limits of the JAX records; the agent cuts to the same (inject/agent/jaxmeta.py LIMITS)
HLO_LIMITS = {"id": 128, "module": 512, "platform": 32, "instr": 1024, "opcode": 64, "op_name": 2048,
              "file": MAX_STR, "func": 1024, "event": 128, "fun_name": 256}

KNOWN_KINDS = ("samples", "kernel", "api", "memcpy", "sync", "note", "stats", "hlo", "compile", "bye",
               "cupti_layout", "cupti_raw", "cupti_ref", "inductor")
MAX_FREE = 256              # addresses per "free" message back to the agent
MAX_RAW_HEADER = 4096       # bytes of a raw frame's JSON header
# Bytes the records waiting for poll() may hold (estimated: a message's length, plus RECORD_BYTES
# a record and FRAME_BYTES a Python frame beyond its strings). Part of a session's memory budget
# (issue 17): 64 MiB here + the tree's (cct/window.py DEFAULT_MAX_BYTES) = 256 MiB a session.
MAX_QUEUED_BYTES = 64 << 20
RECORD_BYTES = 160          # a slotted record object, its ints, the deque slots
FRAME_BYTES = 180           # a (file, name, line) tuple, two str headers, the line int

_ENTRY = re.compile(r"agent-(\d+)(?:\.lock|\.sock|-code)")
HOST_AGENT_DIR = Path("/run/stacklens/agents")
CONTAINER_AGENT_DIR = "/tmp/.stacklens-agents"     # inside a target's root (container, chroot)
# Longest wait for an agent directory's flock; it is held for a few syscalls, so only a process
# stopped while holding it (SIGSTOP, a debugger) makes an attach wait this long.
DIR_LOCK_WAIT_S = 30.0

# servers by socket path, so inject_agent(pid, socket_path=srv.path) can wait for the hello
_REGISTRY: dict[str, "AgentServer"] = {}
_REGISTRY_LOCK = threading.Lock()


def _counts(v) -> dict:
    """Counters/gauges of a stats message: bounded keys, finite numbers; ints may be negative
    (e.g. the CUPTI collector's clock_offset_ns, CLOCK_MONOTONIC minus the CUPTI clock)."""
    if type(v) is not dict or len(v) > 32:
        raise ProtocolError("bad counters")
    return {_str(k, 64): (_num(x) if type(x) is float else _int(x, -MAX_INT)) for k, x in v.items()}


def _pyframes(v, maxlen=wire.MAX_STACK_DEPTH, counts=None, modules=False) -> tuple:
    """Python frames (file, name, line): strings cut and escaped (``clip_text``); ``counts``
    (a Counter) gets the cuts and the frames' estimated bytes (``"bytes"``). With ``modules``
    a frame may also be (file, name, line, attribute path, class): a module's forward
    (``inject/agent/sampler.py``), its two names cut and escaped the same way."""
    out = tuple(_pyframe(x, counts, modules) for x in _list(v, maxlen))
    if counts is not None:
        counts["bytes"] += sum(sum(len(s) for s in f if type(s) is str) for f in out) + FRAME_BYTES * len(out)
    return out


def _pyframe(x, counts, modules: bool) -> tuple:
    f = _row(x, 5) if modules and type(x) is list and len(x) == 5 else _row(x, 3)
    frame = (clip_text(f[0], MAX_FRAME_FILE, counts=counts), clip_text(f[1], MAX_FRAME_NAME, counts=counts),
             _int(f[2], 0, 1 << 31))
    if len(f) == 5:
        frame += (clip_text(f[3], MAX_FRAME_NAME, counts=counts), clip_text(f[4], MAX_FRAME_NAME, counts=counts))
    return frame


def _hlo(msg) -> HloMapRecord:
    parts = _int(msg.get("parts"), 1, MAX_HLO_PARTS)
    kernels = []
    L = HLO_LIMITS
    for k in _list(msg.get("k")):
        name, opcode, ops = _row(k, 3)
        kernels.append(HloKernel(_str(name, L["instr"]), _str(opcode, L["opcode"]),
                                 tuple((_str(o[0], L["op_name"]), _str(o[1], L["file"]), _int(o[2], 0, 1 << 31),
                                        _str(o[3], L["func"]))
                                       for o in (_row(x, 4) for x in _list(ops, MAX_HLO_OPS)))))
    return HloMapRecord(_str(msg.get("id"), L["id"]), _str(msg.get("module"), L["module"]),
                        _str(msg.get("platform"), L["platform"]), _int(msg.get("part"), 0, parts - 1), parts,
                        _pyframes(msg.get("site")), tuple(kernels))


def _safe_names(recs: list) -> list:
    """Records of a raw CUPTI buffer with their names (kernel names read from the target's
    memory) escaped like every string from the agent (``textsafe.py``)."""
    for i, r in enumerate(recs):
        name = getattr(r, "name", None)
        if type(name) is str:
            safe = safe_text(name)
            if safe is not name:
                recs[i] = dataclasses.replace(r, name=safe)
    return recs


def parse_message(msg, counts=None) -> list:
    """One decoded JSON message -> records. Raises ProtocolError on anything unexpected.
    ``counts`` (a Counter, optional): strings cut (``truncated_strings``) and the estimated bytes
    of the samples' frames (``bytes``)."""
    if type(msg) is not dict:
        raise ProtocolError("not an object")
    t = msg.get("t")
    if t == "samples":
        stacks = []
        for st in _list(msg.get("stacks"), 5000):
            stacks.append(_pyframes(st, counts=counts, modules=True))
        out = []
        for s in _list(msg.get("s")):
            tid, t_ns, idx, trunc = _row(s, 4)
            _int(idx, 0, len(stacks) - 1)
            out.append(PySample(_int(tid, 0, 1 << 31), _int(t_ns), stacks[idx], bool(_int(trunc, 0, 1))))
        return out
    if t in ROW_KINDS:                   # GPU activity rows, either vendor (inject/gpu/rows.py)
        return parse_rows(t, msg)
    if t == "note":
        level = msg.get("level")
        if level not in LEVELS:
            raise ProtocolError("bad note level")
        return [Note(level, _str(msg.get("msg"), 2000), _int(msg.get("t_ns", 0)))]
    if t == "stats":
        gpu = msg.get("gpu", {})
        return [AgentStats(_int(msg.get("samples")), _num(msg.get("sample_hz")),
                           _num(msg.get("sample_cost_us")), _counts(msg.get("dropped", {})), _counts(gpu))]
    if t == "hlo":
        return [_hlo(msg)]
    if t == "compile":
        out = []
        for r in _list(msg.get("r")):
            event, fun, t_ns, dur, tid, frames = _row(r, 6)
            if type(event) is not str or not event.startswith("/jax/"):
                raise ProtocolError("bad compile event")
            out.append(CompileRecord(_str(event, HLO_LIMITS["event"]), _str(fun, HLO_LIMITS["fun_name"]), _int(t_ns),
                                     _int(dur), _int(tid, 0, 1 << 31),
                                     _pyframes(frames)))
        return out
    if t == "inductor":                 # torch.compile's generated modules (inject/inductor.py)
        return [parse_inductor(msg)]
    if t == "bye":
        return []
    raise ProtocolError(f"unknown message kind {str(t)[:32]!r}")


def _open_socket_dir(pid: int, d: Path, tstat: os.stat_result) -> tuple[int, str]:
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
def _dir_lock(dirfd: int, name: str):
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


def _take_pid_lock(dirfd: int, pid: int) -> int:
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


def _remove_files(dirfd: int, pid: int) -> None:
    """A server's socket, code directory and lock file (in that order: the lock goes last)."""
    for remove in (lambda: os.unlink(f"agent-{pid}.sock", dir_fd=dirfd),
                   lambda: remove_tree(dirfd, f"agent-{pid}-code"),
                   lambda: os.unlink(f"agent-{pid}.lock", dir_fd=dirfd)):
        try:
            remove()
        except FileNotFoundError:
            pass


def _clean_stale(dirfd: int, keep: int | None = None) -> int:
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
            _remove_files(dirfd, p)
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
            with _dir_lock(fd, "(start-up sweep)"):
                cleaned += _clean_stale(fd)
        except AttachError:
            pass                                    # held by a stopped process: the next attach cleans it
        finally:
            os.close(fd)
    return cleaned


class AgentServer:
    def __init__(self, pid: int, socket_dir: Path | str | None = None, *, config: dict | None = None,
                 max_records: int = 250_000, max_queued_bytes: int = MAX_QUEUED_BYTES) -> None:
        if type(pid) is not int or pid <= 0:
            raise InputError(f"bad PID {pid!r}")
        self.pid = pid
        self.config = dict(config or {})
        self._stats = collections.Counter()
        self.dir = Path(socket_dir) if socket_dir is not None else default_socket_dir(pid)
        tstat = ProcFS().owner(pid)             # NoSuchProcess when it is gone
        # every file below is created relative to this descriptor, never by a path through the
        # target's root (a symlink there would lead the daemon anywhere on the host: rootpath.py)
        self._dirfd, target_dir = _open_socket_dir(pid, self.dir, tstat)
        self._codefd = -1
        self._lock_fd = -1
        try:
            with _dir_lock(self._dirfd, str(self.dir)):
                self._lock_fd = _take_pid_lock(self._dirfd, pid)
                cleaned = _clean_stale(self._dirfd, keep=pid)
            if cleaned:
                self._stats["stale_cleaned"] += cleaned
            self.token = secrets.token_hex(16)
            self._sock_name = f"agent-{pid}.sock"
            self._code_name = f"agent-{pid}-code"
            self.path = str(self.dir / self._sock_name)
            self.target_path = f"{target_dir}/{self._sock_name}"
            self.agent_dir = self.dir / self._code_name
            self.target_agent_dir = f"{target_dir}/{self._code_name}"
            self._install_agent()
            try:
                os.unlink(self._sock_name, dir_fd=self._dirfd)
            except FileNotFoundError:
                pass
            self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
            old = os.umask(0o177)
            try:
                # bind() takes a path: the directory's descriptor as /proc/self/fd/N, so the
                # socket lands in the directory opened above whatever its path names now
                self._listener.bind(f"{ProcFS().own_fd_path(self._dirfd)}/{self._sock_name}")
            finally:
                os.umask(old)
            if tstat.st_uid != 0:
                os.chown(self._sock_name, 0 if os.geteuid() == 0 else -1, tstat.st_gid, dir_fd=self._dirfd,
                         follow_symlinks=False)
                os.chmod(self._sock_name, 0o660, dir_fd=self._dirfd)   # our directory: no symlink there
        except BaseException:
            if self._lock_fd >= 0:
                self._remove_own_files()
            for fd in (self._codefd, self._lock_fd, self._dirfd):
                if fd >= 0:
                    os.close(fd)
            raise
        self._listener.listen(4)
        self._listener.settimeout(0.1)
        self._records: collections.deque = collections.deque()
        self._sizes: collections.deque = collections.deque()   # estimated bytes of each record
        self._queued_bytes = 0
        self._queue_lock = threading.Lock()     # the reader thread pushes, the session polls
        self._max_records = max_records
        self._max_queued_bytes = max_queued_bytes
        self._conn: socket.socket | None = None
        self._hello: AgentHello | None = None
        self._hello_event = threading.Event()
        self._gone_event = threading.Event()
        self._closing = threading.Event()
        self._send_lock = threading.Lock()
        self._layout = None                 # inject/gpu/cupti.Layout of the current agent (cupti_layout message)
        self._names: NameReader | None = None   # kernel names of raw CUPTI records, from /proc/PID/mem
        self._to_free: list[int] = []       # addresses of cupti_ref buffers read, not yet handed back
        self._thread = threading.Thread(target=self._serve, name=f"stacklens-agent-server-{pid}", daemon=True)
        self._thread.start()
        with _REGISTRY_LOCK:
            _REGISTRY[self.path] = self

    # -- setup ---------------------------------------------------------------------------
    def _install_agent(self) -> None:
        """Copy the agent sources to a directory the target can read and not write."""
        remove_tree(self._dirfd, self._code_name)
        os.mkdir(self._code_name, 0o755, dir_fd=self._dirfd)
        self._codefd = os.open(self._code_name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC,
                               dir_fd=self._dirfd)
        os.fchmod(self._codefd, 0o755)
        for src in sorted(AGENT_SRC.glob("*.py")):
            self.write_agent_file(src.name, src.read_bytes())
        for sub in AGENT_PACKAGES:          # one level of folders: the GPU collectors (gpu/)
            os.mkdir(sub, 0o755, dir_fd=self._codefd)
            subfd = os.open(sub, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=self._codefd)
            try:
                os.fchmod(subfd, 0o755)
                for src in sorted((AGENT_SRC / sub).glob("*.py")):
                    self._write_file(subfd, src.name, src.read_bytes())
            finally:
                os.close(subfd)

    def write_agent_file(self, name: str, data: bytes) -> str:
        """Write ``name`` (mode 0644, the daemon's) into the agent's code directory; returns its
        path as the target sees it."""
        self._write_file(self._codefd, name, data)
        return f"{self.target_agent_dir}/{name}"

    @staticmethod
    def _write_file(dirfd: int, name: str, data: bytes) -> None:
        if "/" in name or name in ("", ".", ".."):
            raise InputError(f"bad agent file name {name!r}")
        fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644,
                     dir_fd=dirfd)
        with os.fdopen(fd, "wb") as f:
            os.fchmod(fd, 0o644)
            f.write(data)

    def _remove_own_files(self) -> None:
        """Our socket, code and lock, removed under the directory's flock while our lock is still
        held (a server for this PID starting now finds either all of them or none). Where the
        flock cannot be had they stay: once our lock is closed, any later sweep removes them."""
        try:
            with _dir_lock(self._dirfd, str(self.dir)):
                _remove_files(self._dirfd, self.pid)
        except (AttachError, OSError):
            pass

    # -- reader thread -------------------------------------------------------------------
    def _serve(self) -> None:
        while not self._closing.is_set():
            try:
                conn, _ = self._listener.accept()
            except (socket.timeout, BlockingIOError):
                continue
            except OSError:
                if self._closing.is_set():
                    return
                time.sleep(0.05)
                continue
            if not self._admit(conn):
                continue
            self._read_agent(conn)

    def _admit(self, conn: socket.socket) -> bool:
        try:
            cred = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
            peer_pid, _uid, _gid = struct.unpack("3i", cred)
        except OSError:
            peer_pid = -1
        if peer_pid != self.pid:
            self._stats["rejected_peer"] += 1
            conn.close()
            return False
        return True

    def _read_agent(self, conn: socket.socket) -> None:
        conn.settimeout(0.2)
        buf = bytearray()
        hello = False
        self._layout = None                 # each agent connection sends its own layout
        self._to_free = []                  # and gets back only its own buffers
        self._conn = conn
        try:
            while not self._closing.is_set():
                try:
                    data = conn.recv(1 << 16)
                except socket.timeout:
                    continue
                except OSError:
                    break
                if not data:
                    break
                buf += data
                while len(buf) >= 4:
                    n = int.from_bytes(buf[:4], "big")
                    if n > wire.MAX_FRAME:
                        # only a raw CUPTI frame may be bigger than a JSON one: look at its magic
                        if n > wire.MAX_RAW_FRAME or (len(buf) >= 8 and buf[4:8] != wire.RAW_MAGIC):
                            self._stats["rejected_oversize"] += 1
                            return              # cannot resynchronise: drop the connection
                    if len(buf) < 4 + n:
                        break
                    # one copy of the frame; both views released before buf is resized
                    with memoryview(buf) as mv, mv[4:4 + n] as frame:
                        raw = bytes(frame)
                    del buf[:4 + n]
                    self._stats["frames"] += 1
                    if raw[:4] == wire.RAW_MAGIC:
                        if not hello:
                            self._stats["rejected_hello"] += 1
                            return
                        self._raw_frame(raw)
                        continue
                    try:
                        msg = json.loads(raw)
                    except (ValueError, RecursionError):
                        self._stats["rejected_json"] += 1
                        continue
                    if not hello:
                        if not self._accept_hello(msg):
                            return
                        hello = True
                        continue
                    kind = msg.get("t") if type(msg) is dict else None
                    if kind == "bye":
                        # the agent's last message: its detach is over even while children it
                        # forked (DataLoader workers) still hold a copy of its socket, so the
                        # wait ends here, not at an EOF that may come much later
                        self._stats["bye"] += 1
                        return
                    try:
                        if kind == "cupti_layout":
                            self._layout = parse_layout(msg)
                            self._stats["cupti_layouts"] += 1
                            continue
                        if kind == "cupti_ref":
                            self._ref_frame(msg)
                            continue
                        counts = collections.Counter()
                        recs = parse_message(msg, counts)
                    except (ProtocolError, TypeError, IndexError, KeyError, RecursionError):
                        self._reject(kind)
                        continue
                    if counts["truncated_strings"]:
                        self._stats["truncated_strings"] += counts["truncated_strings"]
                    self._push(recs, n + counts["bytes"])
                while self._to_free:        # the buffers read in place go back to the agent
                    self._send({"t": "free", "a": self._to_free[:MAX_FREE]})
                    del self._to_free[:MAX_FREE]
                if len(buf) > wire.MAX_RAW_FRAME + 4:
                    self._stats["rejected_oversize"] += 1
                    return
        finally:
            self._conn = None
            try:
                conn.close()
            except OSError:
                pass
            if self._names is not None:       # the target's memory is not held between agents
                self._names.close()
            if hello:
                self._gone_event.set()

    def _reject(self, kind) -> None:
        self._stats["rejected_message"] += 1
        self._stats["rejected_message:" + (kind if kind in KNOWN_KINDS else "other")] += 1

    def _raw_frame(self, raw: bytes) -> None:
        """A raw CUPTI buffer frame (magic, header length, JSON header, body; wire.py) -> records."""
        self._stats["raw_frames"] += 1

        def body():
            hl = int.from_bytes(raw[4:8], "big")
            if len(raw) < 8 or hl > MAX_RAW_HEADER or 8 + hl > len(raw):
                raise ProtocolError("bad raw header length")
            return json.loads(raw[8:8 + hl]), memoryview(raw)[8 + hl:]
        self._parse_buffer("cupti_raw", body)

    def _ref_frame(self, msg: dict) -> None:
        """A CUPTI buffer left in place in the target (``cupti_ref``: header, address, length):
        read through /proc/PID/mem, parsed like a raw frame, then handed back (``free``) so the
        agent can reuse it. The target sends no bulk bytes over the socket for these buffers."""
        self._stats["ref_frames"] += 1

        def body():
            addr = _int(msg.get("a"), 1, MAX_INT)
            self._to_free.append(addr)          # freed back whatever else is wrong with it
            n = _int(msg.get("n"), 1, MAX_BLOCK)
            header = msg.get("h")
            if type(header) is not dict:
                raise ProtocolError("bad cupti_ref header")
            data = self._names.read_block(addr, n)
            if data is None:
                self._stats["ref_unreadable"] += 1
                raise ProtocolError("CUPTI buffer reference not readable")
            return header, data
        self._parse_buffer("cupti_ref", body)

    def _parse_buffer(self, kind: str, body) -> None:
        """One CUPTI buffer (``body()`` -> header, bytes; raises ProtocolError) -> records, with
        the parser's counters; anything wrong rejects it (counted) and the connection goes on."""
        try:
            header, data = body()          # self._names: this connection's, opened at hello
            if self._layout is None:
                raise ProtocolError("CUPTI buffer before any cupti_layout")
            recs, counts = parse_raw(header, data, self._layout, self._names)
        except (ProtocolError, ValueError, TypeError, IndexError, KeyError, RecursionError, struct.error):
            self._reject(kind)
            return
        st = self._stats
        for k, v in counts.items():
            if v:
                st[k] += v
        self._push(_safe_names(recs), sum(len(getattr(r, "name", "")) for r in recs))

    def _accept_hello(self, msg) -> bool:
        try:
            if type(msg) is not dict or msg.get("t") != "hello" or msg.get("v") != wire.VERSION:
                raise ProtocolError("first message is not a hello")
            if msg.get("token") != self.token:
                raise ProtocolError("bad token")
            py = _row(msg.get("python"), 3)
            hello = AgentHello(_int(msg.get("pid"), 1, 1 << 31), _int(msg.get("tid"), 0, 1 << 31),
                               (_int(py[0], 0, 99), _int(py[1], 0, 99), _int(py[2], 0, 99)),
                               _str(msg.get("executable", ""), 4096))
        except (ProtocolError, TypeError):
            self._stats["rejected_hello"] += 1
            return False
        self._hello = hello
        self._gone_event.clear()
        self._push([hello])
        if self._names is not None:
            self._names.close()
        self._names = NameReader(self.pid)      # this connection's; closed when it ends
        config = dict(self.config)
        if not self._names.readable():
            # no access to /proc/PID/mem (a daemon without CAP_SYS_PTRACE in a container, a
            # non-dumpable target): buffers left in place could not be read, so they travel as
            # copies (kernel names then stay unresolved, counted)
            config["gpu_ref"] = False
            self._stats["target_memory_unreadable"] += 1
        self._send({"t": "config", **config})
        self._hello_event.set()
        return True

    def _push(self, recs: list, nbytes: int = 0) -> None:
        """Queue ``recs`` (``nbytes``: the estimated bytes of their message beyond RECORD_BYTES
        each), dropping (counted) what does not fit the count or the byte bound."""
        if not recs:
            return
        each = RECORD_BYTES + nbytes // len(recs)
        st = self._stats
        with self._queue_lock:
            for r in recs:
                if len(self._records) >= self._max_records or self._queued_bytes + each > self._max_queued_bytes:
                    st["dropped_records"] += 1
                    st["dropped_bytes"] += each
                    continue
                self._records.append(r)
                self._sizes.append(each)
                self._queued_bytes += each
                st["records"] += 1

    def _send(self, msg: dict) -> bool:
        conn = self._conn
        if conn is None:
            return False
        try:
            with self._send_lock:
                conn.sendall(wire.encode(msg))
            return True
        except OSError:
            return False

    # -- API -----------------------------------------------------------------------------
    @property
    def connected(self) -> bool:
        return self._conn is not None and self._hello_event.is_set() and not self._gone_event.is_set()

    @property
    def hello(self) -> AgentHello | None:
        return self._hello

    def wait_hello(self, timeout_s: float) -> bool:
        return self._hello_event.wait(timeout_s)

    def reset_hello(self) -> None:
        self._hello_event.clear()

    def poll(self, max_n: int | None = None) -> list:
        """Records received so far (at most max_n; the rest stay for the next call)."""
        with self._queue_lock:
            q = self._records
            n = len(q) if max_n is None else min(max_n, len(q))
            pop, sizes = q.popleft, self._sizes
            out = [pop() for _ in range(n)]
            self._queued_bytes -= sum(sizes.popleft() for _ in range(n))
        return out

    @property
    def queued_bytes(self) -> int:
        """Estimated bytes of the records waiting for ``poll()`` (at most MAX_QUEUED_BYTES)."""
        return self._queued_bytes

    def stop_agent(self, timeout_s: float = 3.0) -> bool:
        """Ask the agent to detach; True once it has closed its end."""
        if not self._hello_event.is_set():
            return True
        self._send({"t": "stop"})
        ok = self._gone_event.wait(timeout_s)
        self._hello_event.clear()
        return ok

    def stats(self) -> dict:
        return dict(self._stats)

    def close(self) -> None:
        if self._closing.is_set():
            return
        try:
            self.stop_agent()
        finally:
            self._closing.set()
            try:
                self._listener.close()
            except OSError:
                pass
            self._thread.join(2.0)
            if self._names is not None:
                self._names.close()
            with _REGISTRY_LOCK:
                _REGISTRY.pop(self.path, None)
            with self._queue_lock:          # what the session never polled goes now
                self._records.clear()
                self._sizes.clear()
                self._queued_bytes = 0
            self._remove_own_files()
            for fd in (self._codefd, self._lock_fd, self._dirfd):
                os.close(fd)

    def __enter__(self) -> "AgentServer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def server_for(path: str) -> AgentServer | None:
    with _REGISTRY_LOCK:
        return _REGISTRY.get(str(path))


__all__ = ["AgentServer", "parse_message", "ProtocolError", "clean_stale_files", "default_socket_dir", "server_for"]
