"""The analyzer's core: Finding, RuleConfig, the registry and plugins, analyze(), purity, and
behaviour on snapshots without GPU time."""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import pytest

import stacklens.analyzer as analyzer
from stacklens.analyzer import Finding, RuleConfig, analyze, registry
from stacklens.cct import CCT, METRICS, Frame
from stacklens.errors import InputError

from tests.unit.test_analyzer_synthetic import SCENARIOS, build

LINE = Frame.python("train.py", "step", 12)
MAIN = Frame.python("train.py", "main", 40)


def snap_with(paths, unavailable=(), meta=None):
    t = CCT(METRICS + ("py_samples",))
    for path, values in paths:
        t.add_many(path, values)
    return t.snapshot(meta=meta or {"duration_s": 1.0}, unavailable=unavailable)


# -- Finding -----------------------------------------------------------------------------


def test_finding_is_frozen_and_validated():
    f = Finding("r", "high", ("py:a.py:f:1",), "t", {"x": 1.0}, "fix", 0.2)
    with pytest.raises(AttributeError):
        f.rule = "other"  # type: ignore[misc]
    with pytest.raises(ValueError):
        Finding("r", "urgent", (), "t")
    with pytest.raises(ValueError):
        Finding("r", "low", (), "t", estimated_saving=1.5)


def test_findings_sorted_by_severity_then_saving():
    fs = [
        Finding("a", "low", (), "t", estimated_saving=0.9),
        Finding("b", "high", (), "t", estimated_saving=0.1),
        Finding("c", "high", (), "t", estimated_saving=0.3),
        Finding("d", "medium", (), "t"),
    ]
    assert [f.rule for f in sorted(fs, key=Finding.sort_key)] == ["c", "b", "d", "a"]


# -- config ------------------------------------------------------------------------------


def test_config_from_dict_and_params():
    cfg = RuleConfig.from_dict({"rules": {"sync_stalls": {"min_share": 0.5}}, "disabled": ["hotspots"]})
    assert cfg.param("sync_stalls", "min_share", 0.05) == 0.5
    assert cfg.param("sync_stalls", "other", 7) == 7
    assert cfg.param("kernel_fusion", "min_share", 0.02) == 0.02
    assert "hotspots" in cfg.disabled
    with pytest.raises(InputError):
        RuleConfig.from_dict({"treshold": 1})
    with pytest.raises(InputError):
        RuleConfig.from_dict({"rules": {"x": 3}})
    with pytest.raises(InputError):
        RuleConfig.from_dict({"rules": {"x": {"min_share": "lots"}}}).param("x", "min_share", 0.1)


def test_threshold_override_silences_a_rule():
    snap = build("gpu_item_sync", fixed=False)
    assert any(f.rule == "sync_stalls" for f in analyze(snap))
    quiet = analyze(snap, {"rules": {"sync_stalls": {"min_share": 0.99}}})
    assert not any(f.rule == "sync_stalls" for f in quiet)


def test_disabled_rules_do_not_run():
    snap = build("gpu_item_sync", fixed=False)
    found = analyze(snap, RuleConfig(disabled=frozenset({"hotspots", "sync_stalls"})))
    assert not any(f.rule in ("hotspots", "sync_stalls") for f in found)


def test_min_saving_drops_small_promises_but_keeps_informational():
    snap = build("gpu_kernel_fusion", fixed=False)
    found = analyze(snap, {"min_saving": 0.5})
    assert found and all(f.estimated_saving == 0.0 or f.estimated_saving >= 0.5 for f in found)
    assert any(f.rule == "hotspots" for f in found)


# -- registry ----------------------------------------------------------------------------


def test_builtin_rules_registered():
    assert set(analyzer.rules()) >= {
        "hotspots", "kernel_fusion", "launch_bound", "sync_stalls", "host_device_copies",
        "layout_conversions", "fp32_gemm", "allocator_churn", "backward_cost",
    }


def test_runtime_registration_and_failing_rule_isolated():
    def custom(snapshot, *, config):
        return [Finding("custom", "medium", (), "custom finding", estimated_saving=0.5)]

    def broken(snapshot, *, config):
        raise RuntimeError("boom")

    analyzer.register("custom", custom)
    analyzer.register("broken", broken)
    try:
        found = analyze(build("gpu_item_sync", fixed=True))
        assert any(f.rule == "custom" for f in found)
        err = [f for f in found if f.rule == "analyzer_error"]
        assert len(err) == 1 and "broken" in err[0].title and "boom" in err[0].title
    finally:
        analyzer.unregister("custom")
        analyzer.unregister("broken")


def test_plugins_from_entry_points(monkeypatch):
    def plugin_rule(snapshot, *, config):
        threshold = config.param("my_plugin", "n", 1)
        return [Finding("my_plugin", "low", (), f"plugin n={threshold}")]

    class EP(SimpleNamespace):
        def load(self):
            if self.value == "bad":
                raise ImportError("no module named bad")
            return plugin_rule

    eps = [EP(name="my_plugin", value="pkg:plugin_rule"), EP(name="bad_plugin", value="bad")]
    monkeypatch.setattr(registry, "entry_points", lambda group: eps if group == "stacklens.rules" else [])
    monkeypatch.setattr(registry, "_plugins", None)
    monkeypatch.setattr(registry, "_plugin_errors", {})
    found = analyze(build("gpu_item_sync", fixed=True), {"rules": {"my_plugin": {"n": 3}}})
    assert [f.title for f in found if f.rule == "my_plugin"] == ["plugin n=3"]
    assert "bad_plugin" in analyzer.plugin_errors()
    monkeypatch.setattr(registry, "_plugins", None)


# -- purity ------------------------------------------------------------------------------


def test_analyzer_imports_nothing_impure():
    code = (
        "import sys, stacklens.analyzer as a; from stacklens.cct.export import load; "
        "bad = [m for m in ('bcc','textual','grpc','prometheus_client','ctypes','torch',"
        "'stacklens.daemon','stacklens.bpf','stacklens.inject','stacklens.tui') if m in sys.modules]; "
        "print(bad); sys.exit(1 if bad else 0)"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


# -- snapshots without GPU time (no agent) -------------------------------------------------

GPU_RULES_WITHOUT_GPU_TIME = ["gpu_kernel_fusion", "gpu_launch_bound", "gpu_h2d_copies", "gpu_fp32_gemm",
                              "gpu_item_sync", "gpu_alloc_churn"]


@pytest.mark.parametrize("name", GPU_RULES_WITHOUT_GPU_TIME)
def test_rules_work_without_gpu_time(name):
    _, rule, line = SCENARIOS[name]
    snap = build(name, fixed=False, gpu=False)
    found = [f for f in analyze(snap) if f.rule == rule and line in f.path]
    assert found, f"{rule} needs GPU time it was not given"
    for f in analyze(snap):
        assert "gpu_time_ns" not in f.evidence and "kernel_count" not in f.evidence
        assert not any(k.startswith("gpu_share") for k in f.evidence)
    assert any(f.evidence.get("gpu_time_ns_unavailable") == 1.0 for f in found) or rule in (
        "host_device_copies", "allocator_churn", "sync_stalls")


def test_gpu_only_judgements_are_not_guessed_without_gpu_time():
    snap = build("gpu_launch_bound", fixed=False, gpu=False)
    (f,) = [f for f in analyze(snap) if f.rule == "launch_bound"]
    assert f.severity == "low" and f.estimated_saving == 0.0 and "not measured" in f.title
    (g,) = [f for f in analyze(build("gpu_fp32_gemm", fixed=False, gpu=False)) if f.rule == "fp32_gemm"]
    assert g.severity == "low" and g.estimated_saving == 0.0


def test_empty_and_unmeasured_snapshots():
    assert analyze(CCT(METRICS).snapshot()) == []
    everything_missing = CCT(METRICS).snapshot(unavailable=set(METRICS))
    assert analyze(everything_missing) == []


# -- rule details on small hand-made trees ------------------------------------------------


def test_layout_conversion_inside_conv_suggests_channels_last():
    conv = (MAIN, LINE, Frame.op("aten::conv2d"), Frame.op("aten::convolution"), Frame.op("aten::contiguous"),
            Frame.op("aten::clone"), Frame.op("aten::copy_"))
    snap = snap_with([(conv, {"cpu_samples": 30}), ((MAIN, LINE, Frame.op("aten::conv2d")), {"cpu_samples": 70})])
    (f,) = [f for f in analyze(snap) if f.rule == "layout_conversions"]
    assert "channels_last" in f.fix and f.path[-1] == LINE.label()
    assert f.evidence["cpu_share"] == pytest.approx(0.3)


def test_host_to_device_copy_is_not_a_layout_conversion():
    path = (MAIN, LINE, Frame.op("aten::to_device"), Frame.op("aten::_to_copy"), Frame.op("aten::copy_"),
            Frame.api("cuMemcpyHtoD_v2"))
    snap = snap_with([(path, {"cpu_samples": 50, "api_cpu_ns": 500_000_000, "copy_bytes": 1 << 30})])
    rules = {f.rule for f in analyze(snap)}
    assert "host_device_copies" in rules and "layout_conversions" not in rules


def test_backward_without_forward_link_is_not_charged():
    bwd = (MAIN, Frame.python("torch/_tensor.py", "backward", 625),
           Frame.op("autograd::engine::evaluate_function: MmBackward0"), Frame.op("MmBackward0"), Frame.op("aten::mm"))
    snap = snap_with([(bwd, {"cpu_samples": 90}), ((MAIN, LINE, Frame.op("aten::mm")), {"cpu_samples": 10})])
    assert not [f for f in analyze(snap) if f.rule == "backward_cost"]


def test_fp32_gemm_kernel_names():
    from stacklens.analyzer.rules.gemm import is_fp32_gemm

    for name in ("ampere_sgemm_128x64_nn", "volta_sgemm_64x64_nt", "cutlass_80_simt_sgemm_128x128_8x4_nn_align1",
                 "sm80_xmma_gemm_f32f32_f32f32_f32_nn_n_tilesize128x128x8_stage3"):
        assert is_fp32_gemm(name), name
    for name in ("cutlass_80_tensorop_s1688gemm_128x128_32x3_nn_align4", "ampere_bf16_s16816gemm_bf16_128x64_ldg8_f2f_tn",
                 "sm80_xmma_gemm_tf32f32_tf32f32_f32_nn_n_tilesize128x128x16", "ampere_fp16_s16816gemm_fp16_64x64",
                 "vectorized_elementwise_kernel<4, CUDAFunctor_add<float>>", "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n"):
        assert not is_fp32_gemm(name), name


def test_inclusive_hotspot_when_no_single_line_dominates():
    outer = (MAIN, Frame.python("model.py", "block", 7))
    paths = [((*outer, Frame.python("model.py", "layer", 20 + i), Frame.op("aten::mm")), {"cpu_samples": 8}) for i in range(8)]
    paths.append(((MAIN, Frame.python("train.py", "log", 3)), {"cpu_samples": 36}))
    found = [f for f in analyze(snap_with(paths)) if f.rule == "hotspots"]
    incl = [f for f in found if "inclusive" in f.title]
    assert [f.path[-1] for f in incl] == ["py:model.py:block:7"]


def test_kernel_fusion_names_the_kernels():
    (f,) = [f for f in analyze(build("gpu_kernel_fusion", False)) if f.rule == "kernel_fusion"]
    assert "torch.compile" in f.fix and "CUDA graphs" in f.fix
    assert "tanh_kernel_cuda" in f.fix and f.evidence["distinct_small_kernels"] == 7


def test_public_api_fallback_gives_the_same_findings():
    """The view reads Snapshot's tuples directly for speed; any object with the public
    Snapshot API (a future snapshot class) must analyse the same."""
    snap = build("gpu_kernel_fusion", fixed=False)

    class PublicOnly:
        def __init__(self, s):
            self._s = s
            for name in ("metrics", "node_count", "unavailable", "meta", "folded_nodes", "root"):
                setattr(self, name, getattr(s, name))

        def __getattr__(self, name):
            if name.startswith("_"):
                raise AttributeError(name)
            return getattr(self._s, name)

    assert analyze(PublicOnly(snap)) == analyze(snap)


def test_kernel_labels_say_what_the_kernel_computes():
    from stacklens.analyzer.rules._common import kernel_label

    mul = ("void at::native::vectorized_elementwise_kernel<4, at::native::binary_internal::MulFunctor<float>, "
           "at::detail::Array<char*, 3> >(int, at::native::binary_internal::MulFunctor<float>, at::detail::Array<char*, 3>)")
    assert kernel_label(mul) == "vectorized_elementwise_kernel[MulFunctor]"
    assert kernel_label("void cutlass::Kernel2<cutlass_80_simt_sgemm_64x64_8x5_nn_align1>(Params)") == \
        "cutlass_80_simt_sgemm_64x64_8x5_nn_align1"
    assert kernel_label("ampere_sgemm_128x64_nn") == "ampere_sgemm_128x64_nn"
