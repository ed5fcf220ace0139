"""A real Prometheus server (Debian's `prometheus`) scrapes stacklensd; PromQL finds the hotspots.

The daemon runs for real (gRPC socket, HTTP exposition); its probes are the fake EventSource so
this test needs no BPF (tests/bpf covers the real probes end to end).
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import time
import urllib.parse
import urllib.request

import pytest

from stacklens.daemon.client import DaemonClient
from stacklens.daemon.core import Daemon
from stacklens.daemon.server import StacklensDaemon
from stacklens.daemon.session import ProcessSession
from tests.fakes.sources import FakeEvent, FakeProbes, py

pytestmark = pytest.mark.skipif(shutil.which("prometheus") is None, reason="Debian package prometheus not installed")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_prometheus_scrapes_hotspots(tmp_path):
    probes: dict[int, FakeProbes] = {}

    def factory(pid, **kw):
        def mk(pid, **_):
            probes[pid] = FakeProbes(pid)
            return probes[pid]

        return ProcessSession(pid, probe_factory=mk, **kw)

    mport, pport = free_port(), free_port()
    d = StacklensDaemon(
        socket_path=str(tmp_path / "run" / "s.sock"), metrics_address=f"127.0.0.1:{mport}", daemon=Daemon(session_factory=factory), top_k=3,
        metrics_hotspots=True,
    )
    d.start()
    target = subprocess.Popen(["sleep", "120"])
    cfg = tmp_path / "prometheus.yml"
    cfg.write_text(
        "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
        f"scrape_configs:\n- job_name: stacklens\n  static_configs:\n  - targets: ['127.0.0.1:{mport}']\n"
    )
    prom = subprocess.Popen(
        ["prometheus", f"--config.file={cfg}", f"--storage.tsdb.path={tmp_path / 'tsdb'}", f"--web.listen-address=127.0.0.1:{pport}"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        with DaemonClient(str(d.socket_path)) as c:
            c.attach(target.pid)
            evs = []
            for i in range(20):  # 20 contexts, weights 1..20: top-3 are hot19, hot18, hot17
                evs += [FakeEvent(kind="cpu_sample", py_stack=(py("main", 1), py(f"hot{i}", 100 + i)))] * (i + 1)
            probes[target.pid].push(*evs)
            q = urllib.parse.quote('stacklens_hotspot_cpu_seconds_total{job="stacklens"}')
            result = []
            deadline = time.time() + 30
            while time.time() < deadline:
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{pport}/api/v1/query?query={q}", timeout=2) as r:
                        result = json.load(r)["data"]["result"]
                except OSError:
                    result = []
                if len(result) == 4:
                    break
                time.sleep(0.5)
            # CPU in seconds: samples / the session's sampling rate (99 Hz)
            contexts = {(r["metric"]["context"], r["metric"]["line"]): float(r["value"][1]) * 99 for r in result}
            assert contexts == pytest.approx({
                ("train.py:hot19:119", "train.py:119"): 20.0,
                ("train.py:hot18:118", "train.py:118"): 19.0,
                ("train.py:hot17:117", "train.py:117"): 18.0,
                ("[other]", "[other]"): float(sum(range(1, 18))),
            })
            assert all(r["metric"]["pid"] == str(target.pid) for r in result)
    finally:
        prom.terminate()
        prom.wait(10)
        target.kill()
        target.wait()
        d.stop()
