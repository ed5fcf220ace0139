"""The metrics endpoint (daemon/metrics_http.py) on its own: it serves any registry, answers what
is not a scrape with 404 or 405 and a collector's failure with 500, and needs nothing of the
collector (daemon/prom.py), which still re-exports its names."""

from __future__ import annotations

import http.client
import subprocess
import sys

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily

from stacklens.daemon import metrics_http, prom


class Fixed:
    def collect(self):
        yield GaugeMetricFamily("fixed_answer", "a constant", value=42)


class Broken:
    def collect(self):
        raise RuntimeError("a collector bug")


def request(server, method: str, path: str) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection(*server.address, timeout=5)
    try:
        conn.request(method, path)
        r = conn.getresponse()
        return r.status, r.read()
    finally:
        conn.close()


@pytest.fixture
def serve():
    servers = []

    def start(collector):
        reg = CollectorRegistry()
        reg.register(collector)
        servers.append(metrics_http.MetricsServer(reg, "127.0.0.1", 0).start())
        return servers[-1]

    yield start
    for s in servers:
        s.shutdown()


@pytest.mark.timeout(60)
def test_the_endpoint_answers_a_scrape_and_nothing_else(serve):
    server = serve(Fixed())
    status, body = request(server, "GET", "/metrics")
    assert status == 200 and b"fixed_answer 42.0" in body
    assert request(server, "GET", "/?x=1")[0] == 200
    assert request(server, "HEAD", "/metrics") == (200, b"")
    assert request(server, "GET", "/other")[0] == 404
    assert request(server, "POST", "/metrics")[0] == 405


@pytest.mark.timeout(60)
def test_a_collector_that_raises_gives_500_and_the_server_goes_on(serve):
    server = serve(Broken())
    assert request(server, "GET", "/metrics")[0] == 500
    assert request(server, "GET", "/metrics")[0] == 500


def test_the_endpoint_imports_nothing_of_what_it_serves():
    code = ("import sys, stacklens.daemon.metrics_http; "
            "print(sorted(m for m in sys.modules if m.startswith(('stacklens.daemon.prom', 'stacklens.cct', "
            "'prometheus_client'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_prom_still_exports_the_endpoint_names():
    for name in ("MetricsServer", "WORKERS", "MAX_CONNECTIONS", "ACCEPT_PAUSE_S"):
        assert getattr(prom, name) is getattr(metrics_http, name)
