"""What a target controls cannot hurt the daemon (issue 17, points 4, 5 and 10): a flood of
unique frames stays within the session's byte budget, a symlinked /tmp in a container leads
nothing outside its root, a forked child does not hold the agent's socket, the remote-debug
opt-out is honoured for every Python version, a stopped target is said to be stopped, and what a
killed daemon left behind is cleaned at the next attach.

Real parts: real targets, real ptrace injection, a real chroot in a private mount namespace.
Needs root (ptrace, mount, chroot); probed, skipped with the reason otherwise.
"""

from __future__ import annotations

import ctypes
import gc
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.interpreters import pyenv_python
from tests.ptrace_probe import skip_module_without_ptrace
from stacklens.cct.window import DEFAULT_MAX_BYTES
from stacklens.daemon.join.joiner import Joiner
from stacklens.errors import AttachError
from stacklens.inject.channel.server import MAX_QUEUED_BYTES, AgentServer
from stacklens.inject.injector import inject_agent
from stacklens.records.agent import PySample

pytestmark = pytest.mark.integration

TARGETS = Path(__file__).resolve().parents[1] / "targets"
PY = sys.executable
PYENV = {v: pyenv_python(full) for v, full in (("3.10", "3.10.13"), ("3.12", "3.12.1"), ("3.13", "3.13.0"))}
LOOP = "import time\nprint('ready', flush=True)\nwhile True: time.sleep(0.01)\n"
SESSION_BUDGET = DEFAULT_MAX_BYTES + MAX_QUEUED_BYTES        # 192 + 64 = 256 MiB


skip_module_without_ptrace()


def start(argv, **kw):
    p = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, **kw)
    line = p.stdout.readline()
    if line != "ready\n":
        p.kill()
        raise AssertionError(f"target did not start: {line!r} {p.communicate()[1]}")
    return p


def stop(p):
    if p.poll() is None:
        p.kill()
    return p.communicate()


def wait_for(cond, timeout=30.0, what="condition"):
    """Wait for an event (``cond()`` true); ``timeout`` only bounds a broken run."""
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.005)


def status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def release_memory() -> None:
    """What the daemon does when a session ends (daemon/core.py): collect, give free heap back."""
    gc.collect()
    ctypes.CDLL(None).malloc_trim(0)


# ---- point 4: memory from a hostile target ------------------------------------------------------

FLOOD_FRAMES = 240_000     # ~380 MB of unique frame strings; without the budget the tree held 711 MB (estimate)


def test_unique_frame_flood_stays_within_the_session_budget(tmp_path):
    q = subprocess.Popen([PY, str(TARGETS / "inject_flood.py")], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    srv = AgentServer(q.pid, tmp_path / "a")
    joiner = Joiner(q.pid, agent=True)
    try:
        release_memory()
        base = status_kib("VmRSS")
        Path("/proc/self/clear_refs").write_text("5")         # VmHWM := VmRSS: the peak from here
        q.stdin.write(f"{srv.path} {srv.token} {FLOOD_FRAMES}\n")
        q.stdin.flush()
        assert q.stdout.readline() == "ready\n"
        samples = 0

        def drained() -> bool:              # the aggregation loop of a session, until the bye
            nonlocal samples
            recs = srv.poll(20_000)
            for r in recs:
                samples += isinstance(r, PySample)
                joiner.on_agent(r)
            return not recs and srv.stats().get("bye", 0) >= 1 and srv.queued_bytes == 0

        wait_for(drained, timeout=600, what="the flood and its bye")
        peak = status_kib("VmHWM") - base
        st = srv.stats()
        mem = joiner.tree.memory()
        assert st.get("rejected_oversize", 0) == 0 and st.get("rejected_message", 0) == 0, st
        # nothing held past the budget: the tree's estimate and the process's real peak
        assert mem["used_bytes"] <= DEFAULT_MAX_BYTES, mem
        assert peak * 1024 < SESSION_BUDGET, f"peak RSS growth {peak / 1024:.0f} MiB, {mem}, {st}"
        # and what the budget cost is counted where users see it
        assert mem["budget_folded_nodes"] > 0, mem
        assert st["truncated_strings"] >= FLOOD_FRAMES // 64, st
        snap = joiner.snapshot()
        assert snap.meta["memory"]["budget_folded_nodes"] == mem["budget_folded_nodes"]
        # samples are never lost to the tree's budget (only their context): every one kept by the
        # channel is counted, the rest were dropped by the channel's queue bound, counted too
        assert snap.total("py_samples") == samples
        assert samples + st.get("dropped_records", 0) == FLOOD_FRAMES // 4
        print(f"\nflood: RSS base {base / 1024:.0f} MiB, peak +{peak / 1024:.0f} MiB, tree {mem['used_bytes'] >> 20} "
              f"MiB, folded {mem['budget_folded_nodes']}, evicted {mem['evicted_buckets']}, channel drops "
              f"{st.get('dropped_records', 0)}", file=sys.stderr)
        del snap
    finally:
        q.stdin.write("exit\n")
        q.stdin.flush()
        q.communicate(timeout=30)
        srv.close()                              # the target exited: its session ends
    del joiner
    release_memory()
    back = status_kib("VmRSS") - base
    assert back * 1024 < 48 << 20, f"{back / 1024:.0f} MiB still held after the session ended"


# ---- point 5: a container whose /tmp is an absolute symlink ------------------------------------

PYROOT = sys.base_prefix        # the venv's interpreter's prefix, bind-mounted into the root


def chroot_target(root: Path, escape: str, inside: bool):
    """A target chrooted into ``root`` in a private mount namespace (/usr, the interpreter and
    /proc bind-mounted read-only), whose /tmp is a symlink to the absolute path ``escape``;
    ``inside``: that path also exists inside the root (a 1777 directory)."""
    for d in ("usr", "proc", PYROOT.lstrip("/")):
        (root / d).mkdir(parents=True)
    for link, to in (("lib", "usr/lib"), ("lib64", "usr/lib64"), ("bin", "usr/bin")):
        (root / link).symlink_to(to)
    (root / "tmp").symlink_to(escape)
    if inside:
        d = root / escape.lstrip("/")
        d.mkdir(parents=True)
        d.chmod(0o1777)
    script = (f"mount -o bind,ro /usr {root}/usr && mount -o bind,ro {PYROOT} {root}{PYROOT} && "
              f"mount -o bind,ro /proc {root}/proc && exec chroot {root} {PYROOT}/bin/python3.11 -c \"$0\"")
    return start(["unshare", "-m", "--propagation", "private", "sh", "-c", script, LOOP])


@pytest.fixture
def escape_dir(tmp_path):
    """A host directory a container's /tmp symlink names (absolute): nothing may appear in it."""
    if not Path(PYROOT, "bin/python3.11").exists() or not shutil.which("unshare"):
        pytest.skip(f"needs {PYROOT} and unshare(1)")
    d = Path(f"/var/tmp/stacklens-escape-{os.getpid()}-{tmp_path.name}")
    d.mkdir(mode=0o1777)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def test_symlinked_tmp_leading_out_of_the_root_is_a_clear_error(tmp_path, escape_dir):
    p = chroot_target(tmp_path / "root", str(escape_dir), inside=False)
    try:
        with pytest.raises(AttachError, match=f"cannot open /tmp inside the root of PID {p.pid}"):
            AgentServer(p.pid)
        assert list(escape_dir.iterdir()) == []          # nothing created on the host
        assert not (tmp_path / "root" / "var").exists()   # nor anywhere inside the root
    finally:
        stop(p)


def test_symlinked_tmp_resolved_inside_the_root_attaches_there(tmp_path, escape_dir):
    root = tmp_path / "root"
    p = chroot_target(root, str(escape_dir), inside=True)
    srv = AgentServer(p.pid)                  # the default directory: inside the target's root
    try:
        assert srv.target_path == f"/tmp/.stacklens-agents/agent-{p.pid}.sock"
        inject_agent(p.pid, srv.path, timeout_s=20)
        got = []
        wait_for(lambda: got.extend(srv.poll()) or any(isinstance(r, PySample) for r in got),
                 what="a sample from the agent in the chroot")
        placed = root / str(escape_dir).lstrip("/") / ".stacklens-agents"   # where the target looks
        made = [placed, *placed.rglob("*")]
        assert placed / f"agent-{p.pid}.sock" in made and placed / f"agent-{p.pid}-code" / "__init__.py" in made
        for f in made:                        # the daemon's, and nobody else may write them
            st = f.lstat()
            assert st.st_uid == 0 and not st.st_mode & 0o022, (f, oct(st.st_mode))
        assert list(escape_dir.iterdir()) == []          # nothing created on the host
        assert srv.stop_agent(10)
    finally:
        srv.close()
        stop(p)
    assert list(escape_dir.iterdir()) == []


# ---- point 10: forked children, the remote-debug opt-out, stopped targets, stale files ----------

FORKER = """
import ctypes, os, sys, threading, time
cmd = []
threading.Thread(target=lambda: [cmd.append(l.strip()) for l in sys.stdin], daemon=True).start()
print('ready', flush=True)
while True:
    if cmd:
        how = cmd.pop()
        # 'raw': libc's fork, which runs no os.register_at_fork hooks (the child keeps every fd)
        pid = ctypes.PyDLL(None).fork() if how == 'raw' else os.fork()
        if pid == 0:
            while True:
                time.sleep(1)
        print(pid, flush=True)
    time.sleep(0.01)
"""


def socket_inodes(pid: int) -> set[str]:
    out = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:"):
            out.add(link)
    return out


@pytest.mark.parametrize("how", ["os", "raw"])
def test_children_forked_while_attached_do_not_delay_the_detach(tmp_path, how):
    p = start([PY, "-c", FORKER])
    child = None
    srv = AgentServer(p.pid, tmp_path / "a")
    try:
        before = socket_inodes(p.pid)
        inject_agent(p.pid, srv.path, timeout_s=20)
        wait_for(lambda: socket_inodes(p.pid) - before, what="the agent's socket in the target")
        agent_sock = socket_inodes(p.pid) - before
        p.stdin.write(how + "\n")
        p.stdin.flush()
        child = int(p.stdout.readline())
        if how == "os":       # the agent's fork hook closes the child's copy
            wait_for(lambda: not socket_inodes(child) & agent_sock, what="the child closing the agent socket")
        else:                 # no hook ran: the child holds the agent's socket open
            assert socket_inodes(child) & agent_sock
        t0 = time.monotonic()
        assert srv.stop_agent(timeout_s=30)          # ended by the agent's bye, not by an EOF
        took = time.monotonic() - t0
        assert took < 5, f"detach took {took:.1f} s with a forked child alive"
        assert srv.stats()["bye"] == 1
    finally:
        srv.close()
        if child:
            os.kill(child, signal.SIGKILL)
        stop(p)


PYTHONS = {"3.11": PY, **{v: p for v, p in PYENV.items() if Path(p).exists()}}


@pytest.mark.parametrize("opt", ["env", "-X"])
@pytest.mark.parametrize("version", sorted(PYTHONS))
def test_remote_debug_opt_out_is_honoured_for_every_version(tmp_path, version, opt):
    env = dict(os.environ)
    argv = [PYTHONS[version], "-c", LOOP]
    if opt == "env":
        env["PYTHON_DISABLE_REMOTE_DEBUG"] = "1"
    else:
        argv[1:1] = ["-X", "disable_remote_debug"]
    p = start(argv, env=env)
    try:
        with AgentServer(p.pid, tmp_path / "a") as srv:
            with pytest.raises(AttachError, match="disabled remote debugging"):
                inject_agent(p.pid, srv.path, timeout_s=5)
        tasks = os.listdir(f"/proc/{p.pid}/task")
        assert len(tasks) == 1 and p.poll() is None      # no agent thread; the target runs on
    finally:
        stop(p)


def test_opt_out_parsing(tmp_path):
    from stacklens.inject.injector import remote_debug_opt_out
    from stacklens.introspect.procfs import ProcFS

    def check(argv, env=b""):
        d = tmp_path / "1"
        d.mkdir(exist_ok=True)
        (d / "cmdline").write_bytes(b"\0".join(a.encode() for a in argv) + b"\0")
        (d / "environ").write_bytes(env)
        return remote_debug_opt_out(ProcFS(tmp_path), 1)

    assert check(["python3", "-X", "disable_remote_debug", "a.py"])
    assert check(["python3", "-Xdisable_remote_debug", "-c", "1"])
    assert check(["python3", "-uX", "disable_remote_debug"])
    assert check(["python3", "a.py"], b"A=1\0PYTHON_DISABLE_REMOTE_DEBUG=1\0")
    assert not check(["python3", "a.py"], b"PYTHON_DISABLE_REMOTE_DEBUG=\0")   # empty: not set
    assert not check(["python3", "a.py", "-X", "disable_remote_debug"])        # the script's args
    assert not check(["python3", "-c", "-X", "disable_remote_debug"])
    assert not check(["python3", "-W", "ignore", "-X", "dev", "a.py"])


def test_a_stopped_target_is_reported_as_stopped(tmp_path):
    p = start([PY, "-c", LOOP])
    try:
        os.kill(p.pid, signal.SIGSTOP)
        wait_for(lambda: Path(f"/proc/{p.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "T",
                 what="state T")
        with AgentServer(p.pid, tmp_path / "a") as srv:
            with pytest.raises(AttachError, match=f"stopped .*kill -CONT {p.pid}"):
                inject_agent(p.pid, srv.path, timeout_s=5)
            os.kill(p.pid, signal.SIGCONT)
            inject_agent(p.pid, srv.path, timeout_s=20)  # continued, it attaches
            assert srv.stop_agent(10)
    finally:
        stop(p)


def test_files_of_a_killed_daemon_are_cleaned_at_the_next_attach(tmp_path):
    d = tmp_path / "a"
    victim = start([PY, "-c", LOOP])
    other = start([PY, "-c", LOOP])
    # a 'daemon' serving the victim, killed with SIGKILL: its lock, socket and code stay behind
    daemon = start([PY, "-c", "import sys, time\nfrom stacklens.inject.channel.server import AgentServer\n"
                    f"srv = AgentServer({victim.pid}, {str(d)!r})\nprint('ready', flush=True)\ntime.sleep(600)\n"])
    try:
        left = {f"agent-{victim.pid}.lock", f"agent-{victim.pid}.sock", f"agent-{victim.pid}-code"}
        assert left <= set(os.listdir(d))
        live = AgentServer(other.pid, d)     # a live server's files are not touched
        try:
            daemon.kill()
            daemon.wait()
            with AgentServer(os.getpid(), d) as srv:        # the next attach, to any process
                assert srv.stats()["stale_cleaned"] == 1
                assert not left & set(os.listdir(d))
                assert f"agent-{other.pid}.sock" in os.listdir(d)
        finally:
            live.close()
    finally:
        for q in (daemon, victim, other):
            stop(q)
