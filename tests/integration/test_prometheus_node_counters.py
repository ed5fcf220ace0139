"""stacklensd's node-wide counters never decrease when a process detaches (a decrease is a counter
reset to Prometheus, and rate() would read it as a burst); each exposition passes promtool.

The daemon runs for real (gRPC socket, HTTP exposition); its probes are the fake EventSource, so
this needs no BPF. Scrapes run all through the detach, so one that lands while the session is
being retired is checked too.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import threading
import time
import urllib.request

import pytest

from stacklens.daemon.client import DaemonClient
from stacklens.daemon.core import Daemon
from stacklens.daemon.prom import NODE_COUNTERS
from stacklens.daemon.server import StacklensDaemon
from stacklens.daemon.session import ProcessSession
from tests.fakes.sources import FakeEvent, FakeProbes, py

NODE = [f"stacklens_{n}_total" for n in NODE_COUNTERS] + ["stacklens_series_evicted_total"]


class CountingProbes(FakeProbes):
    """Fake probes whose own counters grow: drops and unwind errors, as a busy ring has."""

    def stats(self):
        n = len(self.q)
        return {"events": n, "drops": 3, "unwind_errors": 2}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        return r.read().decode()


def node_values(text: str) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name in NODE:
            out[name] = float(value)
    return out


@pytest.mark.timeout(120)
def test_node_counters_do_not_decrease_across_a_detach(tmp_path):
    probes: dict[int, CountingProbes] = {}

    def factory(pid, **kw):
        def mk(pid, **_):
            probes[pid] = CountingProbes(pid)
            return probes[pid]

        return ProcessSession(pid, probe_factory=mk, **kw)

    port = free_port()
    d = StacklensDaemon(socket_path=str(tmp_path / "run" / "s.sock"), metrics_address=f"127.0.0.1:{port}",
                        daemon=Daemon(session_factory=factory), top_k=3, metrics_hotspots=True)
    d.start()
    targets = [subprocess.Popen(["sleep", "120"]) for _ in range(2)]
    seen: list[dict[str, float]] = []
    texts: list[str] = []
    stop = threading.Event()
    scraped = threading.Condition()

    def scraper():
        while not stop.is_set():
            text = scrape(port)
            with scraped:
                seen.append(node_values(text))
                if len(texts) < 50:
                    texts.append(text)
                scraped.notify_all()
            time.sleep(0.005)

    def scrapes_reach(n: int) -> None:   # the scraper's progress, not a guessed time (a busy machine)
        with scraped:
            assert scraped.wait_for(lambda: len(seen) >= n, timeout=120), f"{len(seen)} scrapes"

    try:
        with DaemonClient(str(d.socket_path)) as c:
            for i, t in enumerate(targets):
                c.attach(t.pid)
                probes[t.pid].push(*[FakeEvent(kind="cpu_sample", py_stack=(py("main", 1), py(f"f{j}", 10 + j)))
                                     for j in range(20 * (i + 1))])
            deadline = time.time() + 30
            while node_values(scrape(port)).get("stacklens_events_total", 0) < 60:
                assert time.time() < deadline, "the sessions did not join their events"
                time.sleep(0.1)
            before = node_values(scrape(port))
            assert before["stacklens_attaches_total"] == 2 and before["stacklens_drops_total"] == 6
            assert before["stacklens_unwind_errors_total"] == 4
            th = threading.Thread(target=scraper, daemon=True)
            th.start()
            scrapes_reach(3)
            c.detach(targets[0].pid)            # its series go; the node totals keep what it counted
            scrapes_reach(len(seen) + 3)         # scrapes during and after the detach
            stop.set()
            th.join(10)
            after_text = scrape(port)
            after = node_values(after_text)
        assert f'pid="{targets[0].pid}"' not in after_text and f'pid="{targets[1].pid}"' in after_text
        assert after["stacklens_events_total"] == 60 and after["stacklens_drops_total"] == 6
        assert after["stacklens_detaches_total"] == 1 and after["stacklens_attaches_total"] == 2
        assert 'stacklens_attached_processes 1.0' in after_text
        assert len(seen) >= 2
        # what the exposition reads: the detached session's final stats are kept (not just the
        # collector's high-water mark holding the last value)
        st = d.daemon.node_stats()
        assert st["events"] == 60 and st["bpf_drops"] == 6 and st["detaches"] == 1
        for name in NODE:
            values = [before[name]] + [s[name] for s in seen] + [after[name]]
            assert all(a <= b for a, b in zip(values, values[1:])), (name, values)
        if shutil.which("promtool") is not None:
            for text in texts[:: max(1, len(texts) // 5)] + [after_text]:
                r = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, text=True)
                assert r.returncode == 0, r.stdout + r.stderr
    finally:
        stop.set()
        for t in targets:
            t.kill()
            t.wait()
        d.stop()
