"""Prometheus collector over snapshots: names, units, hotspot bound (off by default), and promtool's
linter; the endpoint: stalled clients hold no worker, EMFILE does not spin the selector."""

from __future__ import annotations

import errno
import shutil
import socket
import subprocess
import time
import urllib.request

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from stacklens.cct import CCT, Frame, metrics
from stacklens.daemon.join import DAEMON_METRICS
from stacklens.daemon import prom
from stacklens.daemon.prom import MetricsServer, StacklensCollector, context_label


def make_snapshot(n_contexts: int, unavailable=("gpu_time_ns", "kernel_count")):
    t = CCT(metrics=DAEMON_METRICS, max_nodes=4 * n_contexts + 100)
    for i in range(n_contexts):
        path = (
            Frame.python("/srv/train.py", "step", 10),
            Frame.python("/srv/model.py", f"block{i}", 100 + i),
            Frame.op("aten::addmm"),
            Frame.api("cuLaunchKernel"),
        )
        t.add_many(path, {"cpu_samples": i + 1, "launch_count": 2, "sync_wait_ns": 1000 * i})
    return t.snapshot(meta={"pid": 42}, unavailable=set(unavailable))


def registry_for(snap, **kw):
    reg = CollectorRegistry()
    reg.register(StacklensCollector(lambda: [(42, "python3", "", snap, {"drops": 3})], health=lambda: {"events": 9}, **kw))
    return reg


def test_totals_units_and_unavailable():
    snap = make_snapshot(10)
    reg = registry_for(snap)
    lv = {"pid": "42", "comm": "python3", "container": ""}
    assert reg.get_sample_value("stacklens_kernel_launches_total", lv) == 20
    assert reg.get_sample_value("stacklens_sync_wait_seconds_total", lv) == pytest.approx(45_000e-9)
    assert reg.get_sample_value("stacklens_cpu_samples_total", lv) == 55
    # GPU time was not measured: no value, an explicit unavailable marker instead
    assert reg.get_sample_value("stacklens_gpu_kernel_seconds_total", lv) is None
    assert reg.get_sample_value("stacklens_metric_unavailable", {**lv, "metric": "gpu_time_ns"}) == 1
    assert reg.get_sample_value("stacklens_process_dropped_events_total", lv) == 3
    assert reg.get_sample_value("stacklens_attached_processes") == 1
    assert reg.get_sample_value("stacklens_events_total") == 9


def test_hotspots_bounded_to_k_plus_other_with_10000_contexts():
    snap = make_snapshot(10_000)
    assert "stacklens_hotspot" not in generate_latest(registry_for(snap)).decode()  # off by default
    reg = registry_for(snap, top_k=10, hotspots=True)
    text = generate_latest(reg).decode()
    series = [l for l in text.splitlines() if l.startswith("stacklens_hotspot_cpu_samples_total{")]
    assert len(series) == 11
    assert any('context="[other]"' in l for l in series)
    total = sum(float(l.rsplit(" ", 1)[1]) for l in series)
    assert total == snap.total("cpu_samples")
    top = reg.get_sample_value(
        "stacklens_hotspot_cpu_samples_total",
        {"pid": "42", "comm": "python3", "container": "", "context": "model.py:block9999:10099 > aten::addmm > api:cuLaunchKernel"},
    )
    assert top == 10_000


def test_series_cap_counts_evictions():
    snap = make_snapshot(100)
    coll = StacklensCollector(lambda: [(1, "a", "", snap, {}), (2, "b", "", snap, {})], top_k=10, series_cap=15,
                              hotspots=True)
    reg = CollectorRegistry()
    reg.register(coll)
    text = generate_latest(reg).decode()
    hot = [l for l in text.splitlines() if l.startswith("stacklens_hotspot_") and not l.startswith("#")]
    assert len(hot) == 15
    assert coll.series_evicted > 0


def test_context_label_is_short_and_bounded():
    path = (Frame.python("/a/b/model.py", "forward", 17), Frame.op("aten::linear"), Frame.kernel("x" * 500))
    label = context_label(path)
    assert label.startswith("model.py:forward:17 > aten::linear > kernel:")
    assert len(label) <= 120


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool not installed (Debian package prometheus)")
def test_promtool_check_metrics_passes():
    text = generate_latest(registry_for(make_snapshot(50), hotspots=True)).decode()
    r = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def fully_measured_snapshot():
    """Every metric of the registry measured and non-zero (an agent with CUPTI, a JAX target)."""
    t = CCT(metrics=metrics.ALL, max_nodes=None)
    path = (Frame.python("/srv/train.py", "step", 10), Frame.api("cuMemcpyAsync"))
    t.add_many(path, {m: 1_000 * (i + 1) for i, m in enumerate(metrics.ALL)})
    return t.snapshot(meta={"pid": 42})


def test_every_registry_metric_is_exported_with_its_help_and_unit():
    snap = fully_measured_snapshot()
    text = generate_latest(registry_for(snap)).decode()
    reg = registry_for(snap)
    lv = {"pid": "42", "comm": "python3", "container": ""}
    for i, m in enumerate(metrics.REGISTRY):
        name = f"stacklens_{m.prom}_total"
        assert f"# HELP {name} {m.help}\n" in text, name
        want = 1_000 * (i + 1) * (1e-9 if m.kind == metrics.TIME else 1)
        assert reg.get_sample_value(name, lv) == pytest.approx(want), name
    for old in ("gpu_kernel_seconds", "gpu_kernels", "kernel_launches", "api_cpu_seconds", "sync_wait_seconds",
                "copied_bytes", "allocated_bytes", "cpu_samples"):   # names scrapers already use
        assert f"stacklens_{old}_total{{" in text, old
    for new in ("gpu_memcpys", "gpu_memsets", "memset_bytes", "python_samples", "compile_seconds"):
        assert f"stacklens_{new}_total{{" in text, new


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool not installed (Debian package prometheus)")
def test_promtool_passes_with_every_metric_measured():
    text = generate_latest(registry_for(fully_measured_snapshot(), hotspots=True)).decode()
    r = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.fixture
def server():
    srv = MetricsServer(registry_for(make_snapshot(10)), "127.0.0.1", 0).start()
    yield srv
    srv.shutdown()


@pytest.mark.timeout(60)
def test_clients_that_send_one_byte_and_stall_do_not_starve_a_scrape(server):
    stalled = [socket.create_connection(server.address) for _ in range(2 * prom.WORKERS)]
    try:
        for c in stalled:
            c.sendall(b"G")
        time.sleep(0.2)  # the stalled bytes have arrived before the scrape
        t0 = time.monotonic()
        text = urllib.request.urlopen(f"http://127.0.0.1:{server.address[1]}/metrics", timeout=2).read().decode()
        assert time.monotonic() - t0 < 2 and "stacklens_attached_processes 1.0" in text
    finally:
        for c in stalled:
            c.close()


class ExhaustedListener:
    """The server's listener while the process is out of descriptors: accept fails with EMFILE."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.accepts = 0

    def fileno(self) -> int:
        return self.sock.fileno()

    def accept(self):
        self.accepts += 1
        raise OSError(errno.EMFILE, "Too many open files")

    def close(self) -> None:
        self.sock.close()


@pytest.mark.timeout(60)
def test_emfile_pauses_the_listener_instead_of_spinning():
    srv = MetricsServer(registry_for(make_snapshot(10)), "127.0.0.1", 0)
    srv._listener = listener = ExhaustedListener(srv._listener)
    srv.start()
    client = socket.create_connection(srv.address)  # queued: the listener stays readable
    try:
        time.sleep(0.5)
        # ~1 try per ACCEPT_PAUSE_S, where a spinning selector makes tens of thousands
        assert 1 <= listener.accepts <= 2 + 0.5 / prom.ACCEPT_PAUSE_S, listener.accepts
        assert srv._thread.is_alive()
    finally:
        client.close()
        srv.shutdown()
