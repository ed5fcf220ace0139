"""Unit tests of the TUI's pure view-model functions (no Textual app)."""

from __future__ import annotations

import math

import pytest

from stacklens.cct import Frame
from stacklens.tui import model
from stacklens.tui.source import FileSource, advice_from_finding, analyze_locally, load_profile
from stacklens.tui.testing import PY_MODEL, PY_TRAIN, sample_snapshot, synthetic_snapshot

from stacklens.cct import CCT, METRICS


@pytest.fixture(scope="module")
def snap():
    return sample_snapshot()


def labels(rows):
    return [[f.name for f in r.frames] for r in rows]


def test_fmt_value_units():
    assert model.fmt_value("gpu_time_ns", 6_400_000) == "6.4ms"
    assert model.fmt_value("gpu_time_ns", 2_500_000_000) == "2.50s"
    assert model.fmt_value("sync_wait_ns", 900) == "900ns"
    assert model.fmt_value("copy_bytes", 3 << 20) == "3.0MiB"
    assert model.fmt_value("cpu_samples", 25) == "25"
    assert model.fmt_value("launch_count", 123_456) == "123.5k"
    assert model.fmt_value("gpu_time_ns", 1500, signed=True) == "+1.5us"
    assert model.fmt_value("gpu_time_ns", -1500) == "-1.5us"


def test_every_time_and_bytes_metric_reads_as_time_and_bytes():
    # compile_time_ns was not in the TUI's own list of ns metrics: 2.5 s read "2500.0M"
    assert model.fmt_value("compile_time_ns", 2_500_000_000) == "2.50s"
    assert model.fmt_value("memset_bytes", 3 << 20) == "3.0MiB"
    assert model.fmt_value("memcpy_count", 12_345) == "12.3k"
    assert model.metric_label("compile_time_ns") == "compile time"


def test_the_metric_cycle_visits_every_measured_metric_of_the_registry():
    from stacklens.cct import metrics

    t = CCT(metrics.ALL)   # the daemon's tree holds them all (daemon/join/joiner.py)
    t.add_many((Frame.op("aten::mm"),), {m: 1 for m in metrics.ALL})
    snap = t.snapshot()
    seen, m = [], model.default_metric(snap)
    for _ in metrics.ALL:
        seen.append(m)
        m = model.next_metric(snap, m)
    assert m == seen[0] and sorted(seen) == sorted(metrics.ALL)


def test_the_metric_cycle_skips_unavailable_and_empty_metrics():
    snap = sample_snapshot(gpu=False)   # gpu time and kernel count not measured; py samples empty
    assert model.measured_metrics(snap) == (
        "launch_count", "api_cpu_ns", "sync_wait_ns", "cpu_samples", "alloc_bytes", "copy_bytes")
    seen, m = [], model.default_metric(snap)
    for _ in range(12):
        seen.append(m)
        m = model.next_metric(snap, m)
    assert set(seen) == set(model.measured_metrics(snap))
    assert model.next_metric(snap, "gpu_time_ns") == "launch_count"       # from an unmeasured one
    assert model.next_metric(snap, "gpu_time_ns", -1) == "copy_bytes"
    empty = CCT(METRICS).snapshot()
    assert model.next_metric(empty, "gpu_time_ns") == "gpu_time_ns"      # nothing to go to: stays


def test_cpu_samples_are_time_where_the_sampling_rate_is_known():
    snap = sample_snapshot()   # meta cpu_hz = 99
    unit = model.unit_of(snap, "cpu_samples")
    assert unit.hz == 99 and unit.label == "cpu time"
    assert unit.fmt(99) == "1.00s" and unit.fmt(33) == "333.3ms" and unit.fmt(-3, signed=True) == "-30.3ms"
    assert model.unit_of(snap, "gpu_time_ns") == model.Unit("gpu_time_ns")   # not a sampled metric
    t = CCT(METRICS)
    t.add_many((Frame.op("aten::mm"),), {"cpu_samples": 7})
    for meta in ({}, {"cpu_hz": 0}, {"cpu_hz": "fast"}, {"cpu_hz": float("nan")}):
        unit = model.unit_of(t.snapshot(meta=meta), "cpu_samples")
        assert unit.hz == 0 and unit.label == "cpu samples" and unit.fmt(7) == "7"   # counts, said so


def test_shares_keep_their_sign_in_a_diff():
    assert model.fmt_share(25, 100) == " 25.0%"
    assert model.fmt_share(25, 100, signed=True) == " +25.0%"
    assert model.fmt_share(-3.5, 100, signed=True) == "  -3.5%"
    assert model.fmt_share(0, 100, signed=True) == "   0.0%"
    assert model.fmt_share(5, 0, signed=True) == "  -  "


def test_line_values_sum_each_line_once():
    t = CCT(METRICS, max_nodes=None)
    f = "/srv/job/train.py"
    outer = Frame.python(f, "main", 10)
    rec = Frame.python(f, "step", 20)
    t.add_many((outer, rec, Frame.op("aten::mm")), {"cpu_samples": 4})
    t.add_many((outer, rec, rec, Frame.op("aten::add")), {"cpu_samples": 2})        # recursion: line 20 twice
    t.add_many((outer, Frame.python(f, "step", 21)), {"cpu_samples": 1})
    t.add_many((Frame.python("/srv/job/other.py", "x", 10),), {"cpu_samples": 9})   # another file
    snap = t.snapshot()
    assert model.line_values(snap, "cpu_samples", f) == {10: 7, 20: 6, 21: 1}
    assert model.line_values(snap, "gpu_time_ns", f) == {}
    assert model.line_values(snap, "nope", f) == {}


def test_bar_fills_in_eighths():
    assert model.bar(1.0, 4) == "████"
    assert model.bar(0.0, 4) == "    "
    assert model.bar(0.5, 4) == "██  "
    assert model.bar(1 / 16, 4) == "▎   "
    assert model.bar(2.0, 3) == "███"
    assert model.bar(math.nan, 3) == "   "


def test_default_metric_skips_unavailable_and_empty():
    assert model.default_metric(sample_snapshot()) == "gpu_time_ns"
    assert model.default_metric(sample_snapshot(gpu=False)) == "cpu_samples"


def test_next_metric_cycles(snap):
    assert model.next_metric(snap, "gpu_time_ns") == "kernel_count"
    assert model.next_metric(snap, "gpu_time_ns", -1) == "copy_bytes"
    assert model.next_metric(snap, "nope") == snap.metrics[0]


def test_tree_rows_collapsed_top_level(snap):
    rows = model.tree_rows(snap, "gpu_time_ns", set())
    assert len(rows) == 1
    r = rows[0]
    assert [f.name for f in r.frames] == ["<module>", "main", "train_step"]  # one chain, one row
    assert r.incl == 7_300_000 and r.excl == 0 and r.has_children and not r.expanded


def test_tree_rows_expanded_sorted_and_zero_hidden(snap):
    rows = model.tree_rows(snap, "gpu_time_ns", model.hot_path_keys(snap, "gpu_time_ns"))
    assert labels(rows)[1][:3] == ["forward", "aten::linear", "aten::addmm"]
    assert rows[1].incl == 6_400_000 and rows[2].incl == 900_000
    assert rows[1].depth == 1 and not rows[1].has_children
    # train_step:47 (.item()) and the data loader have no GPU time: hidden
    assert not any("__next__" in n for r in rows for n in [f.name for f in r.frames])


def test_tree_rows_sorts(snap):
    keys = model.hot_path_keys(snap, "kernel_count")
    by_incl = model.tree_rows(snap, "kernel_count", keys)
    assert by_incl[1].frames[-1].name == "vectorized_elementwise_kernel"
    by_name = model.tree_rows(snap, "kernel_count", keys, sort="name")
    assert by_name[1].frames[0] == Frame.python(PY_MODEL, "forward", 88)


def test_tree_rows_without_chains(snap):
    keys = model.hot_path_keys(snap, "gpu_time_ns")
    rows = model.tree_rows(snap, "gpu_time_ns", keys, collapse_chains=False)
    assert [len(r.frames) for r in rows[:4]] == [1, 1, 1, 1]
    assert [r.depth for r in rows[:4]] == [0, 1, 2, 3]


def test_tree_rows_caps_children_with_a_more_row():
    t = CCT(METRICS, max_nodes=None)
    for i in range(10):
        t.add((Frame.op(f"aten::op{i}"),), "cpu_samples", 10 - i)
    s = t.snapshot()
    rows = model.tree_rows(s, "cpu_samples", set(), max_children=4)
    assert len(rows) == 5
    assert rows[-1].more == 6 and rows[-1].incl == sum(range(1, 7)) and rows[-1].label == "… 6 more"


def test_row_index_of_key_falls_back_to_covering_or_ancestor_row(snap):
    rows = model.tree_rows(snap, "gpu_time_ns", model.hot_path_keys(snap, "gpu_time_ns"))
    assert model.row_index_of_key(rows, rows[1].key) == 1
    assert model.row_index_of_key(rows, rows[1].key[:5]) == 1  # inside the chain
    assert model.row_index_of_key(rows, rows[1].key + (Frame.op("gone"),)) == 1
    assert model.row_index_of_key(rows, (Frame.op("elsewhere"),)) is None


def test_search_nodes_heaviest_first(snap):
    hits = model.search_nodes(snap, "KERNEL:", "gpu_time_ns")
    names = [snap.frame_of(n).name for n in hits]
    assert names == ["sm90_xmma_gemm_f32f32_tn", "vectorized_elementwise_kernel"]
    assert model.search_nodes(snap, "   ", "gpu_time_ns") == []
    assert [snap.frame_of(n).name for n in model.search_nodes(snap, "model.py:90", "gpu_time_ns")] == ["forward"]


def test_ancestor_keys_reveal_a_node(snap):
    node = model.search_nodes(snap, "cuStreamSynchronize", "sync_wait_ns")[0]
    rows = model.tree_rows(snap, "sync_wait_ns", model.ancestor_keys(snap, node), collapse_chains=False)
    assert model.row_index_of(rows, node) is not None


def test_icicle_levels_are_proportional(snap):
    levels = model.icicle(snap, "gpu_time_ns", snap.root, 100, 20)
    assert levels[0][0].width == 100
    fwd = levels[4]
    assert [b.frame.line for b in fwd] == [88, 90]
    assert fwd[0].width == round(100 * 6.4 / 7.3) and fwd[0].start == 0
    assert fwd[1].start == fwd[0].width
    assert model.icicle(snap, "gpu_time_ns", snap.root, 0, 5) == []
    assert len(model.icicle(snap, "gpu_time_ns", snap.root, 100, 3)) == 3


def test_hotspots_by_exclusive_with_context(snap):
    spots = model.hotspots(snap, "gpu_time_ns")
    assert [h.frame.name for h in spots] == ["sm90_xmma_gemm_f32f32_tn", "vectorized_elementwise_kernel"]
    assert spots[0].context == "forward  model.py:88 › aten::addmm"
    assert spots[0].values == {"gpu_time_ns": 6_400_000, "cpu_samples": 3, "sync_wait_ns": 0}
    sync = model.hotspots(snap, "sync_wait_ns")
    assert sync[0].frame.name == "cuStreamSynchronize" and "train_step  train.py:47" in sync[0].context


def test_hotspots_signed_uses_absolute_values():
    t = CCT(METRICS, max_nodes=None)
    t.add((Frame.op("a"),), "cpu_samples", -50)
    t.add((Frame.op("b"),), "cpu_samples", 10)
    spots = model.hotspots(t.snapshot(), "cpu_samples", signed=True)
    assert [h.frame.name for h in spots] == ["a", "b"]


def test_fit_chain_keeps_python_and_ops():
    frames = (
        Frame.python(PY_MODEL, "forward", 88),
        Frame.op("aten::linear"),
        Frame.native("libtorch_cuda.so", "at::native::addmm_out_cuda"),
        Frame.native("libtorch_cuda.so", "at::cuda::blas::gemm"),
        Frame.api("cuLaunchKernel"),
        Frame.kernel("gemm"),
    )
    assert model.fit_chain(frames, 500) == list(frames)
    fitted = model.fit_chain(frames, 60)
    assert fitted[0] == frames[0] and fitted[1] == frames[1] and fitted[-1] == frames[-1]
    assert None in fitted and frames[2] not in fitted


def test_source_excerpt(tmp_path):
    f = tmp_path / "t.py"
    f.write_text("".join(f"x{i}\n" for i in range(1, 101)))
    ex = model.source_excerpt(Frame.python(str(f), "g", 50), context=3)
    assert ex.first_line == 47 and ex.lines == ("x47", "x48", "x49", "x50", "x51", "x52", "x53")
    ex = model.source_excerpt(Frame.python(str(f), "g", 1), context=2)
    assert ex.first_line == 1 and ex.lines == ("x1", "x2", "x3")
    # the target's root is tried first
    ex = model.source_excerpt(Frame.python("/t.py", "g", 2), context=0, roots=(str(tmp_path), ""))
    assert ex.lines == ("x2",)
    assert "not readable" in model.source_excerpt(Frame.python("/nope/x.py", "g", 1)).message
    assert "no Python frame" in model.source_excerpt(Frame.op("aten::mm")).message
    assert "no source file" in model.source_excerpt(Frame.python("<string>", "g", 1)).message


def test_nearest_python_and_context(snap):
    node = model.search_nodes(snap, "sm90", "gpu_time_ns")[0]
    assert model.nearest_python(snap, node) == Frame.python(PY_MODEL, "forward", 88)
    assert model.nearest_python(snap, snap.root) is None


def test_status_text():
    s = model.Status(
        source="pid 4242",
        state="attached",
        window_s=10.0,
        metric="gpu_time_ns",
        diff=True,
        paused=True,
        nodes=12345,
        folded=10,
        stats={"bpf_drops": 3, "bpf_lost_samples": 2, "events": 99},
        unavailable=("gpu_time_ns",),
    )
    text = model.status_text(s)
    assert text == (
        "attached · diff last 10 s vs the 10 s before · metric gpu time · drops 5 · unavailable: gpu time"
        " · PAUSED · 12,345 nodes (10 folded)"
    )


def test_process_cells_show_unavailable_never_zero():
    row = model.ProcessRow(1, "python", True, False, "attached", "3.12", float("nan"), 12.34, 0.5)
    assert model.process_cells(row) == (
        "1", "python", "attached", "no", "unavailable", "unavailable", "12.3", "50.0%", "-", "-", "3.12")
    rank = model.ProcessRow(2, "python", True, False, "attached", "3.12", rank="1/4")
    assert model.process_cells(rank)[9] == "1/4"


def test_process_cells_show_the_probes_cost_or_why_not():
    """COST as `ps` shows it: the estimate, "n/a" where the daemon said why there is none, "-"
    where there is nothing to estimate (not attached, fake probes)."""
    def cost(**kw) -> str:
        return model.process_cells(model.ProcessRow(1, "python", True, False, "attached", **kw))[8]

    assert cost(probe_overhead=0.0425) == "4.2%"
    assert cost(overhead_note="first reading: the estimate needs two") == "n/a"
    assert cost() == "-"


def test_cpu_share_from_two_readings_of_cpu_time():
    def row(pid: int, cpu_ns: int | None, t: float) -> model.ProcessRow:
        return model.ProcessRow(pid, "python", True, False, "attached", cpu_time_ns=cpu_ns, read_at=t)

    first = [row(1, 10_000_000_000, 100.0), row(2, None, 100.0), row(3, 5_000_000_000, 100.0)]
    shares, readings = model.cpu_shares({}, first)
    assert shares == {} and set(readings) == {1, 3}
    assert model.process_cells(first[0], shares.get(1))[4] == "…"          # one reading: no rate yet
    assert model.process_cells(first[1], shares.get(2))[4] == "unavailable"  # no CPU time in the reply
    # 3 CPU seconds in 2 s: 150% (threads); PID 3 is a new process (its CPU time went down)
    shares, readings = model.cpu_shares(readings, [row(1, 13_000_000_000, 102.0), row(3, 1_000_000_000, 102.0)])
    assert shares == {1: 1.5} and readings[3] == (1_000_000_000, 102.0)
    assert model.process_cells(row(1, 13_000_000_000, 102.0), shares[1])[4] == "150.0%"


def test_advice_lines_and_order():
    a = model.Advice("r1", "warning", "t1", "do x", (f"py:{PY_TRAIN}:step:3", "op:aten::mm"), (model.Evidence("sync_wait_ns", 5.0, "ns"),), 0.2)
    b = model.Advice("r2", "high", "t2", "do y")
    assert model.sort_advice([a, b]) == [b, a]
    assert model.advice_lines(a) == [
        "[warning] r1: t1",
        "    at step  train.py:3 › aten::mm",
        "    evidence: sync_wait_ns=5 ns",
        "    fix: do x",
        "    estimated saving: 20%",
    ]


def test_advice_from_protobuf_finding():
    from stacklens.daemon import stacklens_pb2 as pb

    f = pb.Finding(rule="sync", severity="high", path=["op:aten::item"], title="t", fix="f", estimated_saving_share=0.3)
    f.evidence.add(metric="sync_wait_ns", value=3.0, unit="ns")
    a = advice_from_finding(f)
    assert a.path == ("op:aten::item",) and a.evidence[0].value == 3.0 and a.saving_share == 0.3


def test_analyze_locally_is_a_value_not_an_exception(snap):
    out = analyze_locally(snap)
    assert isinstance(out, (list, str))
    assert analyze_locally(None) == "no profile yet"


def test_load_profile_missing_file_is_input_error(tmp_path):
    from stacklens.errors import InputError

    with pytest.raises(InputError):
        load_profile(str(tmp_path / "missing.json"))


def test_file_source_roundtrip(tmp_path):
    export = pytest.importorskip("stacklens.cct.export")
    path = tmp_path / "run.json"
    export.save(sample_snapshot(), str(path))
    src = FileSource.open(str(path))
    assert src.name == "run.json" and not src.live
    f = src.fetch(None)
    assert f.snapshot.total("gpu_time_ns") == 7_300_000 and f.final


def test_tree_rows_cost_is_bounded_by_expansion():
    big = synthetic_snapshot(20_000)
    rows = model.tree_rows(big, "gpu_time_ns", set())
    assert len(rows) <= model.MAX_CHILDREN + 1


def test_tui_imports_no_probes_or_injector():
    """The TUI talks to the daemon over gRPC only (the import-linter contract, checked at runtime)."""
    import subprocess
    import sys

    code = (
        "import sys, stacklens.tui.app, stacklens.tui.source, stacklens.daemon.client\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[:2] in (['stacklens','bpf'], ['stacklens','inject']) or m == 'bcc')\n"
        "print(','.join(bad))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


def test_status_without_drop_counters_says_nothing_about_drops():
    assert "drops" not in model.status_text(model.Status(state="file", nodes=1))
    assert model.status_text(model.Status(state="file", nodes=1)) == "file · cumulative · 1 node"


def test_run_top_errors_before_the_ui(tmp_path):
    from stacklens.errors import DaemonUnavailable, InputError
    from stacklens.tui.app import run_top

    with pytest.raises(InputError, match="no such file"):
        run_top(None, str(tmp_path / "missing.json.gz"), "/nonexistent/s.sock")
    with pytest.raises(DaemonUnavailable, match="not running"):
        run_top(None, None, str(tmp_path / "s.sock"))


def test_shown_snapshot_picks_the_model_view_where_there_are_module_calls():
    from stacklens.tui.testing import gpt2_snapshot

    gpu = gpt2_snapshot()
    shown, view = model.shown_snapshot(gpu, "auto")
    assert view == "model" and shown.meta["view"] == "model"
    assert model.shown_snapshot(gpu, "full") == (gpu, "full")
    plain = sample_snapshot()
    assert model.shown_snapshot(plain, "auto") == (plain, "full")
    assert model.other_view("model") == "full" and model.other_view("auto") == "model"
    assert model.frame_text(Frame.module("transformer.h.3.attn", "GPT2Attention")) == "transformer.h.3.attn · GPT2Attention"
    assert model.kind_tag(Frame.module("", "GPT2Model")) == "mod"
    assert "model view (v: full)" in model.status_text(model.Status(metric="gpu_time_ns", view="model"))
    assert "view" not in model.status_text(model.Status(metric="gpu_time_ns", view="full"))


def test_daemon_process_listing_carries_cpu_time_for_cpu_percent(daemon):
    """A real stacklensd (fake probes behind the Protocol) over its socket: each listed process has
    its CPU time so far, read from /proc, so the process list can show CPU% from two listings."""
    import subprocess
    import sys

    from stacklens.introspect.procfs import ProcFS
    from stacklens.tui.source import DaemonProcesses

    # a target that spends some CPU, then sleeps: its CPU time is non-zero and stays put
    target = subprocess.Popen([sys.executable, "-c", "sum(range(3_000_000)); print('ready', flush=True); "
                               "import time; time.sleep(60)"], stdout=subprocess.PIPE, text=True)
    try:
        assert target.stdout.readline().startswith("ready")
        procs = DaemonProcesses.connect(str(daemon.socket_path))
        procs.attach(target.pid)
        first = {p.pid: p for p in procs.processes()}[target.pid]
        second = {p.pid: p for p in procs.processes()}[target.pid]
        assert first.cpu_time_ns == ProcFS().cpu_time_ns(target.pid) > 0
        assert second.read_at > first.read_at
        shares, _ = model.cpu_shares(model.cpu_shares({}, [first])[1], [second])
        assert model.process_cells(second, shares.get(target.pid))[4] == "0.0%"   # asleep between the two
    finally:
        target.kill()
        target.wait()
