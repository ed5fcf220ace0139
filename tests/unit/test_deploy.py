"""What deploy/ ships for monitoring: the Prometheus alert rules pass `promtool check rules` and
their unit tests (`promtool test rules`), the Grafana dashboard is a well-formed dashboard model
(schemaVersion, templating, panels with gridPos, datasource and PromQL targets that parse), and
every metric the rules and the dashboard query is one the daemon exports."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from prometheus_client import generate_latest

from stacklens.cct import CCT, Frame, metrics
from stacklens.daemon.prom import Source, StacklensCollector, build_registry

REPO = Path(__file__).parents[2]
RULES = REPO / "deploy/prometheus/stacklens-rules.yml"
RULES_TEST = REPO / "deploy/prometheus/stacklens-rules.test.yml"
DASHBOARD = REPO / "deploy/grafana/stacklens.json"
# what Prometheus adds to every target, beside what the exposition holds
SYNTHETIC = {"up", "scrape_duration_seconds", "scrape_samples_scraped"}
GRAFANA_VARS = {"__rate_interval", "__interval", "__range"}
PANEL_TYPES = {"row", "timeseries", "stat", "table", "bargauge", "gauge"}
KEYWORDS = {"and", "or", "unless", "bool", "offset", "by", "without", "on", "ignoring", "group_left", "group_right",
            "inf", "nan"}

needs_promtool = pytest.mark.skipif(shutil.which("promtool") is None,
                                    reason="promtool not installed (Debian package prometheus)")


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects (functions, keywords, labels, strings and
    Grafana variables left out)."""
    e = re.sub(r'"(?:\\.|[^"\\])*"', '""', expr)
    e = re.sub(r"\{[^}]*\}", " ", e)
    e = re.sub(r"\[[^\]]*\]", " ", e)
    e = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", e)
    e = re.sub(r"\$\{?\w+\}?", " ", e)
    names = set()
    for m in re.finditer(r"[A-Za-z_:][A-Za-z0-9_:]*", e):
        before = e[m.start() - 1] if m.start() else " "
        if before.isdigit() or before == ".":      # 1e9, 0.5e3
            continue
        if e[m.end():].lstrip().startswith("(") or m.group() in KEYWORDS:   # a function or an aggregation
            continue
        names.add(m.group())
    return names


def test_metric_names_parser():
    assert metric_names('sum by (pid, comm) (rate(stacklens_cpu_seconds_total{pid=~"$pid", line!="a b"}[$__rate_interval]))'
                        ' / on(pid) group_left(comm) up * 1e9 > bool 0.5') == {"stacklens_cpu_seconds_total", "up"}
    assert metric_names("count(stacklens_agent_connected == 0) or vector(0)") == {"stacklens_agent_connected"}
    assert metric_names("time() - process_start_time_seconds") == {"process_start_time_seconds"}


def exposed_names() -> set[str]:
    """Every sample name of the daemon's registry with every family populated: all metrics of the
    registry measured, hotspots on, an agent, a finding, the node counters, the process metrics."""
    t = CCT(metrics=metrics.ALL, max_nodes=None)
    t.add_many((Frame.python("/srv/train.py", "step", 10), Frame.api("cuLaunchKernel")),
               {m: 1_000 * (i + 1) for i, m in enumerate(metrics.ALL)})
    snap = t.snapshot(meta={"pid": 42}, unavailable={metrics.ALL[0]})
    full = t.snapshot(meta={"pid": 43})
    coll = StacklensCollector(lambda: [Source(42, "a", "", snap, {"drops": 1}, cpu_hz=99, agent_connected=True,
                                              probe_overhead=0.05),
                                       Source(43, "b", "", full, {}, cpu_hz=99, agent_connected=False)],
                              health=lambda: {"events": 1}, findings=lambda pid, s: {"sync_stall": 1}, hotspots=True)
    reg = build_registry(coll)
    names = {s.name for fam in reg.collect() for s in fam.samples}
    assert {"stacklens_hotspot_cpu_seconds_total", "stacklens_metric_unavailable", "stacklens_findings",
            "stacklens_agent_connected", "stacklens_probe_overhead_ratio",
            "process_resident_memory_bytes"} <= names   # every family is there
    return names | SYNTHETIC


def rule_fields(key: str) -> list[str]:
    """The `key:` values of the rules file, a plain scalar or a folded block (`>-`): the subset of
    YAML that file is written in (no YAML library in the test environment; promtool checks the rest)."""
    lines = RULES.read_text().splitlines()
    out = []
    for i, line in enumerate(lines):
        m = re.fullmatch(rf"(\s*)(?:- )?{key}: (.*)", line)
        if not m:
            continue
        value = m.group(2).strip()
        if value in (">-", ">", "|"):
            indent = len(m.group(1))
            block = []
            for nxt in lines[i + 1:]:
                if nxt.strip() and len(nxt) - len(nxt.lstrip()) <= indent:
                    break
                block.append(nxt.strip())
            value = " ".join(b for b in block if b)
        out.append(value)
    return out


def dashboard_targets(dash: dict) -> list[tuple[dict, dict]]:
    return [(p, t) for p in dash["panels"] if p["type"] != "row" for t in p["targets"]]


@needs_promtool
def test_promtool_checks_the_alert_rules():
    r = subprocess.run(["promtool", "check", "rules", str(RULES)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "SUCCESS: 5 rules found" in r.stdout


@needs_promtool
def test_the_alerts_fire_as_their_unit_tests_say():
    r = subprocess.run(["promtool", "test", "rules", RULES_TEST.name], capture_output=True, text=True, cwd=RULES_TEST.parent)
    assert r.returncode == 0, r.stdout + r.stderr


def test_the_alerts_cover_down_drops_unjoined_and_the_agent():
    alerts = set(rule_fields("alert"))
    assert len(rule_fields("expr")) == len(alerts) == 5
    assert {"StacklensDaemonDown", "StacklensEventsDropped", "StacklensUnjoinedLaunchesRising",
            "StacklensAgentDisconnected"} <= alerts


def test_rules_query_only_exported_metrics():
    exposed = exposed_names()
    for expr in rule_fields("expr"):
        names = metric_names(expr)
        assert names and names <= exposed, (expr, names - exposed)


def test_dashboard_is_a_grafana_dashboard_model():
    dash = json.loads(DASHBOARD.read_text())
    assert isinstance(dash["schemaVersion"], int) and dash["schemaVersion"] >= 36
    assert dash["title"] and re.fullmatch(r"[A-Za-z0-9_-]{1,40}", dash["uid"])
    assert {"from", "to"} <= set(dash["time"])
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids)) and all(isinstance(i, int) for i in ids)
    occupied: set[tuple[int, int]] = set()
    for p in dash["panels"]:
        assert p["type"] in PANEL_TYPES and p["title"], p
        g = p["gridPos"]
        assert all(isinstance(g[k], int) for k in "hwxy") and g["x"] + g["w"] <= 24 and g["h"] > 0, p["title"]
        cells = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not cells & occupied, f"{p['title']} overlaps another panel"
        occupied |= cells
        if p["type"] == "row":
            continue
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
        assert p["targets"], p["title"]
        refs = [t["refId"] for t in p["targets"]]
        assert len(refs) == len(set(refs)), p["title"]
        for t in p["targets"]:
            assert t["datasource"] == p["datasource"] and isinstance(t["expr"], str) and t["expr"], p["title"]
            used = set(re.findall(r"\$\{?(\w+)\}?", t["expr"]))
            assert used <= set(variables) | GRAFANA_VARS, (p["title"], used)
    for v in variables.values():
        if v["type"] == "query":
            assert v["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, v["name"]


def test_dashboard_queries_only_exported_metrics():
    dash = json.loads(DASHBOARD.read_text())
    exposed = exposed_names()
    queries = [t["expr"] for _, t in dashboard_targets(dash)]
    queries += [v["query"]["query"] for v in dash["templating"]["list"] if v["type"] == "query"]
    used = set()
    for q in queries:
        names = metric_names(re.sub(r"^label_values\((.*),\s*\w+\)$", r"\1", q))
        assert names and names <= exposed, (q, names - exposed)
        used |= names
    # what an operator needs is on it: CPU in seconds, agent samples, node counters, the daemon itself
    assert {"stacklens_cpu_seconds_total", "stacklens_python_samples_total", "stacklens_drops_total",
            "stacklens_unjoined_total", "stacklens_agent_connected", "stacklens_hotspot_cpu_seconds_total",
            "stacklens_probe_overhead_ratio",
            "process_resident_memory_bytes", "process_cpu_seconds_total"} <= used


@needs_promtool
def test_dashboard_queries_parse_as_promql(tmp_path):
    """Each target, its Grafana variables filled in, as a recording rule: promtool parses them all."""
    dash = json.loads(DASHBOARD.read_text())
    rules = []
    for p, t in dashboard_targets(dash):
        expr = t["expr"].replace("$__rate_interval", "5m").replace("$__interval", "1m").replace("$__range", "1h")
        expr = re.sub(r"\$\{?\w+\}?", ".*", expr)
        rules.append({"record": f"dashboard:panel{p['id']}_{t['refId']}", "expr": expr})
    path = tmp_path / "dashboard-rules.yml"
    path.write_text(json.dumps({"groups": [{"name": "dashboard", "rules": rules}]}))   # JSON is YAML
    r = subprocess.run(["promtool", "check", "rules", str(path)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"SUCCESS: {len(rules)} rules found" in r.stdout
