"""The probes' estimated cost in `stacklens ps` and Prometheus (issue 42, point 5), as root with
real probes: the uprobe trap is timed on this machine, and the estimate for a launch-bound process (the CPU
stand-in of batch-1 decoding, tests/targets/decode_standin.py) agrees with the slowdown the
process measures itself (its CPU time per launch before and while attached)."""

from __future__ import annotations

import json
import statistics
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from stacklens.bpf.costs import measure_trap_ns
from tests.bpf.conftest import Target
from tests.daemon_proc import Daemon, until


def test_the_trap_is_timed_on_this_machine(bpf_available):
    ns = measure_trap_ns()
    assert 10 < ns < 100_000, ns     # a trap into the kernel and back: not free, not a sleep


def _cpu_per_launch(t: Target, steps: int = 200) -> float:
    t.send(f"steps {steps}")
    _, launches, _wall, cpu = t.readline(timeout=300).split()
    return float(cpu) / int(launches)


def _row(d: Daemon, pid: int) -> dict:
    r = d.cli("ps", "--json")
    assert r.returncode == 0, r.stderr
    return next(p for p in json.loads(r.stdout)["processes"] if p["pid"] == pid)


def _scraped_cost(d: Daemon, pid: int) -> float | None:
    text = urllib.request.urlopen(f"http://127.0.0.1:{d.port}/metrics", timeout=30).read().decode()
    for fam in text_string_to_metric_families(text):
        for sample in fam.samples:
            if sample.name == "stacklens_probe_overhead_ratio" and sample.labels["pid"] == str(pid):
                return sample.value
    return None


def test_ps_estimates_the_probes_cost_the_process_pays(tmp_path, fake_libs, bpf_available):
    d = Daemon(tmp_path)
    t = Target("decode_standin.py", str(fake_libs["dir"]))
    try:
        _cpu_per_launch(t)                                      # warm
        base = statistics.median(_cpu_per_launch(t) for _ in range(5))
        assert d.cli("attach", str(t.pid)).returncode == 0
        assert "measuring" in _row(d, t.pid).get("overhead_note", "")
        during: list[float] = []

        def estimated():
            during.append(_cpu_per_launch(t))                   # launches between two readings
            row = _row(d, t.pid)
            return row if "probe_overhead" in row and len(during) >= 5 else None

        row = until("an estimate in ps", estimated, timeout=300)
        paid = (statistics.median(during) - base) / statistics.median(during)
        print(f"base {base * 1e6:.2f} µs/launch, attached {statistics.median(during) * 1e6:.2f}: paid {paid:.3f}, "
              f"estimated {row['probe_overhead']:.3f}")
        assert 0.5 * paid <= row["probe_overhead"] <= 1.5 * paid, (row, base, during)
        assert "agent's cost is not measured" in row["overhead_note"]
        table = d.cli("ps").stdout
        assert "COST%" in table and f"{100 * row['probe_overhead']:.1f}" in table, table
        scraped = _scraped_cost(d, t.pid)        # the same estimate, as Prometheus reads it
        assert scraped is not None and 0.5 * paid <= scraped <= 1.5 * paid, (scraped, paid)
    finally:
        t.kill()
        d.stop()
