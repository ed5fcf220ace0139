"""One metric vocabulary (cct/metrics.py) and one list of output formats (render/formats.py): every
metric a tree can hold is declared there, and every view reads the declaration instead of keeping
its own table of names and units."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from stacklens.cct import CCT, METRICS, Frame, metrics

REPO = Path(__file__).parents[2]
# Views of a snapshot: none of them may name a metric; they read the registry.
CONSUMERS = ("daemon/prom.py", "render/textreport.py", "render/formats.py", "render/stacks.py", "render/folded.py",
             "render/pprof.py", "render/speedscope.py", "tui/model.py", "tui/widgets.py", "tui/formatting.py",
             "tui/treemodel.py", "tui/codemodel.py", "tui/cctview.py", "tui/icicleview.py", "tui/linetable.py",
             "cct/export.py")
_SUFFIX = {metrics.TIME: "_ns", metrics.BYTES: "_bytes"}


def _strings(tree: ast.AST) -> set[str]:
    return {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)}


def test_names_units_and_prometheus_names_agree():
    assert len(set(metrics.ALL)) == len(metrics.ALL) == len(metrics.REGISTRY)
    prom = [m.prom for m in metrics.REGISTRY]
    assert len(set(prom)) == len(prom)
    for m in metrics.REGISTRY:
        assert m.kind in (metrics.TIME, metrics.COUNT, metrics.BYTES), m
        assert re.fullmatch(r"[a-z][a-z_]*", m.name) and re.fullmatch(r"[a-z][a-z_]*", m.prom), m
        # the suffix tells the unit, so kind_of is right for a metric this table does not know
        suffix = _SUFFIX.get(m.kind)
        assert m.name.endswith(suffix) if suffix else not m.name.endswith(("_ns", "_bytes")), m
        assert m.prom.endswith({"time": "_seconds", "bytes": "_bytes"}.get(m.kind, "")), m
        assert not m.prom.endswith("_total"), m   # the counter family adds it
        assert m.help and m.label and m.needs in ("bpf", "agent", "gpu", "jax"), m
    assert sorted(metrics.PREFERRED) == sorted(metrics.ALL)
    assert set(metrics.HOTSPOT) <= set(metrics.ALL)
    assert METRICS == metrics.DEFAULT and set(METRICS) <= set(metrics.ALL)


def test_every_metric_the_daemon_tree_can_hold_is_in_the_registry():
    from stacklens.daemon.join.joiner import DAEMON_METRICS, Joiner

    # a tree refuses a metric it was not built with (KeyError), and the daemon builds it from this
    assert Joiner(1).tree.metrics == DAEMON_METRICS == metrics.ALL
    # and what the join charges by name is declared: every metric-like key of a dict literal in it
    charged = set()
    for path in sorted(REPO.glob("daemon/join/*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Dict):
                keys = node.keys
            elif isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "add_sample":
                keys = node.args[1:2]   # add_sample(path, METRIC, tid)
            else:
                continue
            charged |= {k.value for k in keys if isinstance(k, ast.Constant) and isinstance(k.value, str)
                        and re.fullmatch(r"[a-z_]+_(ns|count|bytes|samples)", k.value)}
    assert {"cpu_samples", "memcpy_count", "memset_bytes", "kernel_count"} <= charged   # the scan works
    assert charged <= set(metrics.ALL), charged - set(metrics.ALL)


@pytest.mark.parametrize("path", CONSUMERS)
def test_views_name_no_metric_of_their_own(path):
    named = _strings(ast.parse((REPO / path).read_text())) & set(metrics.ALL)
    assert not named, f"{path} names {sorted(named)}: read them from stacklens.cct.metrics"


def test_every_view_formats_by_the_registry_kind():
    from stacklens.daemon.prom import PROCESS_METRICS
    from stacklens.render.textreport import fmt_value as text_fmt
    from stacklens.tui.model import fmt_value as tui_fmt

    assert list(PROCESS_METRICS) == list(metrics.ALL)
    want = {metrics.TIME: "2.50s", metrics.BYTES: "2.0GiB"}
    for m in metrics.REGISTRY:
        assert PROCESS_METRICS[m.name][0] == m.prom and PROCESS_METRICS[m.name][2] == m.help
        assert PROCESS_METRICS[m.name][1] == (1e-9 if m.kind == metrics.TIME else 1)
        value = 2_500_000_000 if m.kind != metrics.BYTES else 2 << 30
        assert tui_fmt(m.name, value) == want.get(m.kind, "2500.0M"), m.name
        assert text_fmt(m.name, value) == want.get(m.kind, "2500000000"), m.name


def test_text_report_totals_show_compile_time_as_time():
    from stacklens.render.textreport import render_report

    t = CCT(metrics.ALL, max_nodes=None)
    t.add_many((Frame.python("/j/step.py", "grow", 3),), {"compile_time_ns": 2_500_000_000, "memset_bytes": 4096,
                                                          "cpu_samples": 1})
    text = render_report(t.snapshot(), "compile_time_ns")
    assert "compile_time_ns=2.50s" in text and "memset_bytes=4.0KiB" in text and "total 2.50s" in text


def test_the_cli_offers_exactly_the_listed_formats_and_each_renders(tmp_path, capsys):
    from stacklens.cli import main as cli
    from stacklens.render.formats import FORMATS

    parser = cli.build_parser()
    for command in ("report", "profile", "record"):
        sub = parser._subparsers._group_actions[0].choices[command]
        fmt = next(a for a in sub._actions if a.dest == "format")
        assert tuple(fmt.choices) == tuple(FORMATS)
    t = CCT(metrics.ALL, max_nodes=None)
    t.add_many((Frame.python("/a.py", "main", 1),), {"cpu_samples": 3})
    snap = t.snapshot()
    for name, form in FORMATS.items():
        out = tmp_path / f"profile{form.extension}"
        cli.write_output(snap, name, "cpu_samples", str(out))
        data = form.render(snap, "cpu_samples")
        assert isinstance(data, bytes) == form.binary and data, name
        assert (out.read_bytes() if form.binary else out.read_text()) == data, name
