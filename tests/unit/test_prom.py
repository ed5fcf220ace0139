"""Prometheus collector over snapshots: names, units (CPU in seconds), hotspot bound with a `line`
label (off by default), node-wide counters that never decrease, the daemon's process metrics, and
promtool's linter; the endpoint: stalled clients hold no worker, EMFILE does not spin the selector."""

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
from stacklens.daemon.join.joiner import DAEMON_METRICS
from stacklens.daemon import prom
from stacklens.introspect.ranks import RankProc
from stacklens.daemon.prom import MetricsServer, Source, StacklensCollector, build_registry, line_label


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
    reg.register(StacklensCollector(lambda: [Source(42, "python3", "", snap, {"drops": 3}, cpu_hz=100)],
                                    health=lambda: {"events": 9}, **kw))
    return reg


def test_totals_units_and_unavailable():
    snap = make_snapshot(10)
    reg = registry_for(snap)
    lv = {"pid": "42", "comm": "python3", "container": "", "rank": "", "local_rank": "", "world_size": ""}
    assert reg.get_sample_value("stacklens_kernel_launches_total", lv) == 20
    assert reg.get_sample_value("stacklens_sync_wait_seconds_total", lv) == pytest.approx(45_000e-9)
    assert reg.get_sample_value("stacklens_cpu_samples_total", lv) == 55
    assert reg.get_sample_value("stacklens_cpu_seconds_total", lv) == pytest.approx(0.55)  # 55 samples at 100 Hz
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
    assert "stacklens_hotspot_cpu_samples_total" not in text   # CPU hotspots are in seconds
    series = [l for l in text.splitlines() if l.startswith("stacklens_hotspot_cpu_seconds_total{")]
    assert len(series) == 11
    assert any('context="[other]",line="[other]"' in l for l in series)
    total = sum(float(l.rsplit(" ", 1)[1]) for l in series)
    assert total == pytest.approx(snap.total("cpu_samples") / 100)
    top = reg.get_sample_value(
        "stacklens_hotspot_cpu_seconds_total",
        {"pid": "42", "comm": "python3", "container": "", "rank": "", "local_rank": "", "world_size": "", "line": "srv/model.py:10099",
         "context": "model.py:block9999:10099 > aten::addmm > api:cuLaunchKernel"},
    )
    assert top == pytest.approx(100.0)


def test_series_cap_counts_evictions():
    snap = make_snapshot(100)
    coll = StacklensCollector(lambda: [Source(1, "a", "", snap, {}, cpu_hz=99), Source(2, "b", "", snap, {}, cpu_hz=99)],
                              top_k=10, series_cap=15, hotspots=True)
    reg = CollectorRegistry()
    reg.register(coll)
    text = generate_latest(reg).decode()
    hot = [l for l in text.splitlines() if l.startswith("stacklens_hotspot_") and not l.startswith("#")]
    assert len(hot) == 15
    # process 1: CPU top-10 + [other] (11), sync wait top-3 + [other] (4): the cap; process 2: none
    sync = [l for l in hot if l.startswith("stacklens_hotspot_sync_wait_seconds_total{")]
    assert len(sync) == 4 and sum(float(l.rsplit(" ", 1)[1]) for l in sync) == pytest.approx(snap.total("sync_wait_ns") / 1e9)
    assert not [l for l in hot if 'pid="2"' in l]
    assert coll.series_evicted == 2   # a counter: each scrape that meets the cap adds to it


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
    lv = {"pid": "42", "comm": "python3", "container": "", "rank": "", "local_rank": "", "world_size": ""}
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


def test_line_label_is_the_innermost_python_line_and_bounded():
    path = (Frame.python("/srv/train.py", "step", 10), Frame.python("/srv/model.py", "forward", 17), Frame.op("aten::mm"))
    assert line_label(path) == "srv/model.py:17"
    assert line_label((Frame.op("aten::mm"), Frame.kernel("gemm"))) == "[none]"
    long = line_label((Frame.python("/x/" + "a" * 500 + ".py", "f", 123456),))
    assert len(long) <= prom.LINE_LABEL_MAX and long.endswith(":123456")


def test_hotspot_lines_are_bounded_per_process_and_the_rest_is_other():
    t = CCT(metrics=DAEMON_METRICS, max_nodes=None)
    for i in range(2_000):   # 2,000 distinct lines, one context each
        t.add_many((Frame.python(f"/srv/m{i}.py", "f", i),), {"cpu_samples": 1 + i % 7})
    snap = t.snapshot()
    reg = registry_for(snap, top_k=5, hotspots=True)
    lines = {l.split('line="', 1)[1].split('"', 1)[0] for l in generate_latest(reg).decode().splitlines()
             if l.startswith("stacklens_hotspot_cpu_seconds_total{")}
    assert len(lines) == 6 and "[other]" in lines


def test_cpu_seconds_need_the_sampling_rate():
    snap = make_snapshot(10)
    reg = CollectorRegistry()
    reg.register(StacklensCollector(lambda: [(42, "python3", "", snap, {})], hotspots=True, top_k=3))  # a rate-less source
    lv = {"pid": "42", "comm": "python3", "container": "", "rank": "", "local_rank": "", "world_size": ""}
    assert reg.get_sample_value("stacklens_cpu_samples_total", lv) == 55
    assert reg.get_sample_value("stacklens_cpu_seconds_total", lv) is None
    assert reg.get_sample_value("stacklens_hotspot_sync_wait_seconds_total",
                                {**lv, "context": "[other]", "line": "[other]"}) is not None


def test_agent_connected_gauge_only_for_processes_with_an_agent():
    snap = make_snapshot(3)
    reg = CollectorRegistry()
    reg.register(StacklensCollector(lambda: [Source(1, "a", "", snap, {}, agent_connected=True),
                                             Source(2, "b", "", snap, {}, agent_connected=False),
                                             Source(3, "c", "", snap, {})]))
    assert reg.get_sample_value("stacklens_agent_connected", {"pid": "1", "comm": "a", "container": "", "rank": "", "local_rank": "", "world_size": ""}) == 1
    assert reg.get_sample_value("stacklens_agent_connected", {"pid": "2", "comm": "b", "container": "", "rank": "", "local_rank": "", "world_size": ""}) == 0
    assert reg.get_sample_value("stacklens_agent_connected", {"pid": "3", "comm": "c", "container": "", "rank": "", "local_rank": "", "world_size": ""}) is None


def test_probe_overhead_gauge_only_where_it_was_estimated():
    snap = make_snapshot(3)
    reg = CollectorRegistry()
    reg.register(StacklensCollector(lambda: [Source(1, "a", "", snap, {}, probe_overhead=0.125),
                                             Source(2, "b", "", snap, {})]))
    lv = {"container": "", "rank": "", "local_rank": "", "world_size": ""}
    assert reg.get_sample_value("stacklens_probe_overhead_ratio", {"pid": "1", "comm": "a", **lv}) == 0.125
    assert reg.get_sample_value("stacklens_probe_overhead_ratio", {"pid": "2", "comm": "b", **lv}) is None


def test_ranks_of_a_distributed_job_carry_rank_labels():
    """Two ranks of one job (their environment read into RankProc) and a process that is no
    rank: the ranks' series carry rank, local_rank and world_size; the other's are empty."""
    snap = make_snapshot(3)
    want = snap.total("cpu_samples")
    ranks = [RankProc(r, 100 + r, r, 2, 2, "127.0.0.1:29500") for r in (0, 1)]
    reg = CollectorRegistry()
    reg.register(StacklensCollector(lambda: [Source(100, "python", "", snap, {}, cpu_hz=99, rank=ranks[0]),
                                             Source(101, "python", "", snap, {}, cpu_hz=99, rank=ranks[1]),
                                             Source(7, "serve", "", snap, {}, cpu_hz=99)]))
    for r in (0, 1):
        lv = {"pid": str(100 + r), "comm": "python", "container": "", "rank": str(r), "local_rank": str(r),
              "world_size": "2"}
        assert reg.get_sample_value("stacklens_cpu_samples_total", lv) == want
    lv = {"pid": "7", "comm": "serve", "container": "", "rank": "", "local_rank": "", "world_size": ""}
    assert reg.get_sample_value("stacklens_cpu_samples_total", lv) == want
    assert 'rank="1"' in generate_latest(reg).decode()


def test_node_counters_never_go_down():
    """A session between its last live stats and its retired ones is missing from the sum once:
    the exported counter holds (a decrease is a counter reset to Prometheus)."""
    health = iter([{"events": 10, "bpf_drops": 2, "launches_unmatched": 1, "attaches": 1},
                   {"events": 4, "bpf_drops": 0, "attaches": 1},            # the session is retiring
                   {"events": 12, "bpf_drops": 3, "launches_unmatched": 2, "kernels_unmatched": 1, "attaches": 2}])
    reg = CollectorRegistry()
    reg.register(StacklensCollector(list, health=lambda: next(health)))
    seen = []
    for _ in range(3):   # one collect per scrape
        values = {s.name: s.value for fam in reg.collect() for s in fam.samples}
        seen.append({n: values[f"stacklens_{n}_total"] for n in ("events", "drops", "unjoined", "attaches")})
    assert seen == [{"events": 10, "drops": 2, "unjoined": 1, "attaches": 1},
                    {"events": 10, "drops": 2, "unjoined": 1, "attaches": 1},
                    {"events": 12, "drops": 3, "unjoined": 3, "attaches": 2}]


def test_the_daemons_own_process_metrics():
    reg = build_registry(StacklensCollector(list))
    assert reg.get_sample_value("process_resident_memory_bytes") > 1 << 20
    assert reg.get_sample_value("process_cpu_seconds_total") > 0
    assert reg.get_sample_value("process_open_fds") >= 3
    assert 0 < time.time() - reg.get_sample_value("process_start_time_seconds") < 24 * 3600
    assert reg.get_sample_value("stacklens_attached_processes") == 0


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool not installed (Debian package prometheus)")
def test_promtool_passes_on_the_daemon_registry():
    snap = fully_measured_snapshot()
    coll = StacklensCollector(lambda: [Source(42, "python3", "", snap, {"drops": 1}, cpu_hz=99, agent_connected=True)],
                              health=lambda: {"events": 5}, hotspots=True)
    text = generate_latest(build_registry(coll)).decode()
    assert "process_resident_memory_bytes" in text
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
