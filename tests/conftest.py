"""Shared fixtures: tier markers by folder, capability probes for root-only tiers, and the check
that the test session leaves no process behind.

Every process the session starts inherits ``STACKLENS_TEST_SESSION`` (set at configure time) in
its environment, however deep and even once reparented to init; processes given an environment of
their own are found as descendants of pytest. At the session's end, after every fixture's
teardown, any still running get a few seconds to exit (each watched through a pidfd), the rest
are killed and listed, and the session fails (issue 26: a failing bpf test once left its target
running for good). multiprocessing's own helpers (resource tracker, forkserver) end with pytest
and are not counted.
"""

from __future__ import annotations

import os
import pathlib
import secrets
import select
import signal
import time

import pytest

TESTS = pathlib.Path(__file__).parent
SESSION_ENV = "STACKLENS_TEST_SESSION"
# for processes already on their way out (a target's forked workers); a test of this check sets less
EXIT_GRACE_S = float(os.environ.get("STACKLENS_TEST_EXIT_GRACE_S", "10"))
PYTEST_HELPERS = ("multiprocessing.resource_tracker", "multiprocessing.forkserver")


def pytest_configure(config):
    os.environ[SESSION_ENV] = f"{os.getpid()}-{secrets.token_hex(4)}"


def session_processes() -> dict[int, str]:
    """Running processes of this test session but pytest itself: pid -> command line."""
    from stacklens.errors import StacklensError
    from stacklens.introspect.procfs import ProcFS

    procfs, me = ProcFS(), os.getpid()
    tag = f"{SESSION_ENV}={os.environ[SESSION_ENV]}".encode()
    parent: dict[int, int] = {}
    state: dict[int, str] = {}
    for pid in procfs.pids():
        try:
            _comm, fields = procfs.stat(pid)
        except (StacklensError, OSError):
            continue
        state[pid], parent[pid] = fields[0], int(fields[1])

    def descends(pid: int) -> bool:
        seen = set()
        while pid > 1 and pid not in seen:
            seen.add(pid)
            pid = parent.get(pid, 0)
            if pid == me:
                return True
        return False

    out = {}
    for pid, st in state.items():
        if pid == me or st in ("Z", "X"):
            continue
        env = procfs.environ(pid) or b""
        if tag in env.split(b"\0") or descends(pid):
            cmd = " ".join(procfs.cmdline(pid))
            if not any(h in cmd for h in PYTEST_HELPERS):
                out[pid] = cmd
    return out


def _wait_exits(fds: set[int], timeout_s: float) -> set[int]:
    """Waits until every pidfd in ``fds`` says its process exited, or ``timeout_s``; returns the
    pidfds of those still running."""
    pending = set(fds)
    poller = select.poll()
    for fd in pending:
        poller.register(fd, select.POLLIN)
    deadline = time.monotonic() + timeout_s
    while pending:
        left_ms = (deadline - time.monotonic()) * 1000
        if left_ms <= 0:
            break
        for fd, _ev in poller.poll(left_ms):
            pending.discard(fd)
            poller.unregister(fd)
    return pending


def end_processes(procs: dict[int, str], grace_s: float = EXIT_GRACE_S) -> dict[int, str]:
    """Waits up to ``grace_s`` for ``procs`` to exit, each watched through a pidfd (so a reused
    PID is never signalled); kills those still running and waits for them to be gone. Returns
    those it had to kill."""
    fds = {}
    for pid in procs:
        try:
            fds[os.pidfd_open(pid)] = pid
        except ProcessLookupError:
            continue
    try:
        killed = {}
        for fd in _wait_exits(set(fds), grace_s):
            try:
                signal.pidfd_send_signal(fd, signal.SIGKILL)
                killed[fd] = fds[fd]
            except ProcessLookupError:
                pass
        _wait_exits(set(killed), grace_s)
        return {pid: procs[pid] for pid in killed.values()}
    finally:
        for fd in fds:
            os.close(fd)


@pytest.hookimpl(trylast=True)   # after _pytest.runner's, which tears the last fixtures down
def pytest_sessionfinish(session, exitstatus):
    if not os.environ.get(SESSION_ENV):
        return
    left = end_processes(session_processes())
    if not left:
        return
    lines = [f"  PID {pid}: {cmd[:200]}" for pid, cmd in sorted(left.items())]
    tr = session.config.pluginmanager.get_plugin("terminalreporter")
    if tr is not None:
        tr.write_sep("=", f"{len(left)} process(es) left running by the test session (killed now)", red=True)
        for line in lines:
            tr.write_line(line)
    session.shouldfail = (f"the test session left {len(left)} process(es) running (killed at its end; "
                          "a test or fixture that starts a process must end it in its teardown)")
    if session.exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_collection_modifyitems(config, items):
    for item in items:
        parts = pathlib.Path(str(item.fspath)).relative_to(TESTS).parts
        tier = parts[0] if len(parts) > 1 else "unit"
        if tier in ("integration", "bpf", "gpu"):
            item.add_marker(getattr(pytest.mark, tier))


BPF_PROBE_PROGRAM = "int sl_cap_probe(void *ctx) { return 0; }"
# a test replaces the capability probe's program (tests/bpf/test_tier_probe.py: a broken one must fail the tier)
BPF_PROBE_ENV = "STACKLENS_TEST_BPF_PROBE"


class BpfTierBroken(Exception):
    """Root with BCC installed, yet a trivial program does not load or attach: a regression, not a
    machine that cannot run the tier."""


def bpf_tier_skip_reason(program: str = BPF_PROBE_PROGRAM) -> str | None:
    """Why the eBPF tier cannot run on this machine (not root, no BCC), or None when it can.
    Under root with BCC importable, the tier runs: a program that fails to load or attach raises
    BpfTierBroken with the loader's error, so a BCC regression fails the run instead of skipping it."""
    if os.geteuid() != 0:
        return "not root: the eBPF tier loads BPF programs and attaches uprobes (run the tests as root)"
    try:
        from bcc import BPF
    except ImportError as e:
        return f"BCC is not importable ({e}): bash scripts/setup.sh installs Debian's python3-bpfcc"
    try:
        b = BPF(text=program.encode())
        b.attach_uprobe(name=b"c", sym=b"getpid", fn_name=b"sl_cap_probe")
        b.cleanup()
    except Exception as e:  # noqa: BLE001 — whatever the loader raised is the message
        raise BpfTierBroken(f"root with BCC, but a trivial BPF program did not load and attach: "
                            f"{type(e).__name__}: {e}") from e
    return None


@pytest.fixture(scope="session")
def bpf_available() -> None:
    """Skip (with the reason) where the tier cannot run; fail where it should and does not."""
    try:
        reason = bpf_tier_skip_reason(os.environ.get(BPF_PROBE_ENV, BPF_PROBE_PROGRAM))
    except BpfTierBroken as e:
        pytest.fail(str(e), pytrace=False)
    if reason is not None:
        pytest.skip(reason)


@pytest.fixture(scope="session")
def ptrace_available() -> None:
    """Skip unless this process may ptrace a throwaway child."""
    from tests.ptrace_probe import ptrace_refused

    why = ptrace_refused()
    if why:
        pytest.skip(why)
