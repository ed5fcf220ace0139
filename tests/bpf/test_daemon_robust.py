"""stacklensd under concurrent clients, as root with real probes (issue 17 acceptance 1 and 2).

- 8 concurrent `stacklens attach` (and detach) through the CLI, twice, then CLI attaches racing
  `--auto-attach` (its housekeeping compiles while the CLI's attaches do, and both go for the same
  fake GPU processes): the daemon does not crash (it did in 8 of 8 runs: two BCC compiles at once),
  and every attach succeeds or fails with a clear one-line message.
  By hand, 2026-12-01 (this 2-vCPU VM, shared with other sessions): `bash
  benchmarks/concurrent_attaches.sh` (20 runs of a fresh daemon + 8 concurrent attaches + 8
  concurrent detaches): 20 of 20 runs, 160 of 160 attaches ok, 22-30 s per 8 attaches
  (docs/benchmarks/soak.md, "Concurrent attaches"). The test does 2 such rounds to stay short.
- 64 streams at the largest interval_ms, then cancelled: `ps` and `attach` answer within 2 s
  throughout, the 8 streams past the cap are refused at once, and SIGTERM with streams still open
  ends the daemon within 5 s.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest

from stacklens.daemon import grpc_service
from stacklens.daemon import stacklens_pb2 as pb
from stacklens.daemon.client import DaemonClient

BIN = Path(sys.executable).parent


class Stacklensd:
    def __init__(self, tmp_path: Path, *extra: str) -> None:
        tmp_path.mkdir(parents=True, exist_ok=True)
        self.sock = tmp_path / "run" / "stacklens.sock"
        self.log_path = tmp_path / "stacklensd.log"
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen([str(BIN / "stacklensd"), "--socket", str(self.sock), "--metrics-address", "off",
                                      *extra], stdout=subprocess.PIPE, stderr=self._log, text=True)
        line = self.proc.stdout.readline()
        assert "ready" in line, (line, self.log_path.read_text())

    def log(self) -> str:
        return self.log_path.read_text()

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> float:
        """SIGTERM; returns the seconds until the process was gone."""
        t0 = time.monotonic()
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(30)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
            self._log.close()
            self.proc.stdout.close()
        return time.monotonic() - t0


@pytest.fixture
def stacklensd(tmp_path, bpf_available):
    made: list[Stacklensd] = []

    def start(*extra: str) -> Stacklensd:
        d = Stacklensd(tmp_path / f"d{len(made)}", *extra)
        made.append(d)
        return d

    yield start
    for d in made:
        if d.alive():
            d.stop()


def cli_start(sock: Path, *commands: tuple[str, ...]) -> list[tuple[tuple[str, ...], subprocess.Popen]]:
    return [(cmd, subprocess.Popen([str(BIN / "stacklens"), "--socket", str(sock), *cmd], stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, text=True)) for cmd in commands]


def cli_wait(started) -> list[subprocess.CompletedProcess]:
    out = []
    for cmd, p in started:
        stdout, stderr = p.communicate(timeout=600)
        out.append(subprocess.CompletedProcess(cmd, p.returncode, stdout, stderr))
    return out


def cli_all(sock: Path, *commands: tuple[str, ...]) -> list[subprocess.CompletedProcess]:
    """Runs the CLI commands at once; returns their results in order."""
    return cli_wait(cli_start(sock, *commands))


def assert_clear(r: subprocess.CompletedProcess, allowed: tuple[str, ...] = ()) -> bool:
    """True when it succeeded; else the failure must be one clear line (and one of `allowed`)."""
    if r.returncode == 0:
        return True
    assert "Traceback" not in r.stderr, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("stacklens: error:"), r.stderr
    assert any(a in lines[0] for a in allowed), r.stderr
    return False


@pytest.mark.timeout(1500)  # 24 attaches; each BCC compile ~3 s idle, far more on a loaded 2-vCPU VM
def test_concurrent_attaches_and_auto_attach_races_do_not_crash(stacklensd, start_target, fake_libs):
    d = stacklensd()
    targets = [start_target("inject_sleep.py") for _ in range(8)]
    t0 = time.monotonic()
    for rnd in range(2):
        res = cli_all(d.sock, *[("attach", str(t.pid)) for t in targets])
        assert d.alive(), f"round {rnd}: the daemon died\n{d.log()[-3000:]}"
        ok = [assert_clear(r) for r in res]
        assert all(ok), [r.stderr for r in res]
        ps = cli_all(d.sock, ("ps",))[0]
        assert ps.returncode == 0 and all(str(t.pid) in ps.stdout for t in targets)
        res = cli_all(d.sock, *[("detach", str(t.pid)) for t in targets])
        assert d.alive() and all(assert_clear(r) for r in res), [r.stderr for r in res]
    two_rounds = time.monotonic() - t0
    assert d.stop() < 10
    # attaches racing the housekeeping's auto-attach: fake GPU processes (they map libcuda) start
    # while CLI attaches of other targets compile, and are attached by the CLI and the scan at once
    d = stacklensd("--auto-attach", "^python")
    others = [start_target("inject_sleep.py") for _ in range(4)]
    first = cli_start(d.sock, *[("attach", str(t.pid)) for t in others])
    gpu = [start_target("fake_cuda_app.py", str(fake_libs["dir"])) for _ in range(4)]
    # gpu[:2] are left to the housekeeping (its compiles overlap the CLI's), gpu[2:] are raced
    second = cli_start(d.sock, *[("attach", str(t.pid)) for t in gpu[2:]])
    res = cli_wait(first + second)
    assert d.alive(), d.log()[-3000:]
    for t, r in zip(others + gpu[2:], res):
        # the housekeeping may win the race for a GPU process: a clear AlreadyAttached
        assert_clear(r, allowed=("already attached",) if t in gpu else ())
    want = {t.pid for t in others + gpu}
    with DaemonClient(str(d.sock)) as c:
        deadline = time.monotonic() + 300
        while not want <= {p.pid for p in c.processes() if p.attached}:  # a scan may still be compiling
            assert time.monotonic() < deadline and d.alive(), d.log()[-3000:]
            time.sleep(0.2)
        counters = dict(c.health().counters)
        cli_ok = sum(r.returncode == 0 for r in res)
        print(f"8 concurrent attaches + 8 detaches, twice: {two_rounds:.1f} s; auto-attach race: "
              f"{cli_ok} by the CLI, {counters.get('attaches', 0) - cli_ok} by the housekeeping, "
              f"{len(res) - cli_ok} CLI attaches refused as already attached; "
              f"auto_attach_raced {counters.get('auto_attach_raced', 0)}, "
              f"auto_attach_failures {counters.get('auto_attach_failures', 0)}")
        assert counters.get("auto_attach_failures", 0) == 0
        assert counters.get("attaches", 0) - cli_ok >= 2  # the housekeeping attached gpu[:2] at least
    assert d.stop() < 10


def _stream(c: DaemonClient, pid: int, interval_ms: int):
    req = pb.StreamRequest(request=pb.SnapshotRequest(pid=pid), interval_ms=interval_ms)
    return c.stub.StreamSnapshots(req, metadata=c._md)


def _timed(fn) -> float:
    t0 = time.monotonic()
    try:
        fn()
    except Exception:  # noqa: BLE001 — the answer may be a refusal; its latency is what counts
        pass
    return time.monotonic() - t0


@pytest.mark.timeout(600)
def test_64_streams_at_the_largest_interval_never_starve_ps_attach_or_sigterm(stacklensd, start_target):
    d = stacklensd()
    t1, t2 = start_target("inject_sleep.py"), start_target("inject_sleep.py")
    worst = {"ps": 0.0, "attach": 0.0}

    def probe(c: DaemonClient) -> None:
        worst["ps"] = max(worst["ps"], _timed(c.processes))
        worst["attach"] = max(worst["attach"], _timed(lambda: c.attach(2)))  # refused at once: a worker answered

    with DaemonClient(str(d.sock), timeout=30) as c:
        c.attach(t1.pid)
        calls, refused = [], 0
        for i in range(64):
            call = _stream(c, t1.pid, grpc_service.MAX_INTERVAL_MS)
            try:
                assert next(call).pid == t1.pid
                calls.append(call)
            except grpc.RpcError as e:
                assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, e
                refused += 1
            if i % 8 == 7:
                probe(c)
        assert (len(calls), refused) == (grpc_service.MAX_STREAMS, 64 - grpc_service.MAX_STREAMS)
        t0 = time.monotonic()
        c.attach(t2.pid)  # a real attach (one BCC compile) is served while the streams are open
        real_attach = time.monotonic() - t0
        for call in calls:
            call.cancel()
        probe(c)
        # the cancelled streams' workers are back: a full set of new streams is accepted
        again = [_stream(c, t1.pid, grpc_service.MAX_INTERVAL_MS) for _ in range(grpc_service.MAX_STREAMS)]
        for call in again:
            assert next(call).pid == t1.pid
        probe(c)
        took = d.stop()  # SIGTERM with 8 streams open and their clients still waiting
    print(f"worst ps {worst['ps']:.2f} s, worst attach answer {worst['attach']:.2f} s, a real attach "
          f"{real_attach:.1f} s, SIGTERM to exit {took:.2f} s")
    assert worst["ps"] < 2.0 and worst["attach"] < 2.0, worst
    assert took < 5.0, took
    assert os.path.exists(d.sock) is False


def test_sigterm_during_the_warm_up_compile_exits_at_once(stacklensd, start_target, tmp_path):
    """CI: a daemon started next to a torch process got SIGTERM while its warm-up compiled, and
    took ~10 s to exit (BCC's exit hooks waited for the compile's lock); the test's 10 s ran out.
    The warm-up's compile cannot be interrupted, so the daemon exits without waiting for it."""
    start_target("inject_torch.py", str(tmp_path / "stop"))   # a torch process: the warm-up compiles for it
    d = stacklensd()
    deadline = time.monotonic() + 120
    while "warm-up: compiling the BPF program" not in d.log():   # for it, or another of its build
        assert d.alive() and time.monotonic() < deadline, d.log()
        time.sleep(0.05)
    took = d.stop()
    log = d.log()
    assert d.proc.returncode == 0, log
    assert re.search(r"still busy: .*the BPF warm-up", log), log   # it was inside the compile when it left
    assert not d.sock.exists()
    print(f"SIGTERM to exit during the warm-up compile: {took:.2f} s")
    assert took < 5.0, (took, log)
