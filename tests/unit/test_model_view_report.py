"""The model view in `stacklens report` and the export formats, on the recorded GPT-2 training
run (tests/data/cpu_gpt2_train/, a CPU recording) and a hand-built GPU step (synthetic)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from stacklens.cct import export
from stacklens.cct.modelview import model_view
from stacklens.cli import main as cli
from stacklens.tui.testing import gpt2_snapshot

RECORDED = Path(__file__).resolve().parents[1] / "data" / "cpu_gpt2_train" / "problem.json"
WRAPPERS = ("Module._wrapped_call_impl", "Module._call_impl", "can_return_tuple.<locals>.wrapper",
            "deprecate_kwarg.<locals>")


def report(capsys, *argv: str) -> str:
    assert cli.main(["report", *argv]) == 0
    return capsys.readouterr().out


def test_recorded_run_opens_in_the_model_view_with_module_paths(capsys) -> None:
    text = report(capsys, "--input", str(RECORDED), "--metric", "py_samples")
    assert "model view:" in text
    for name in ("transformer · GPT2Model", "transformer.h.0 · GPT2Block", "transformer.h.0.attn · GPT2Attention",
                 "transformer.h.1.mlp · GPT2MLP", "GPT2LMHeadModel"):
        assert name in text
    assert not any(w in text for w in WRAPPERS)
    # CPU samples (the BPF walker sees code only) name modules by class
    cpu = report(capsys, "--input", str(RECORDED), "--metric", "cpu_samples", "--view", "model")
    assert "GPT2Attention" in cpu and not any(w in cpu for w in WRAPPERS)


def test_full_view_keeps_every_frame(capsys) -> None:
    text = report(capsys, "--input", str(RECORDED), "--metric", "py_samples", "--view", "full")
    assert "model view:" not in text
    assert all(w in text for w in WRAPPERS[:2])


def test_recorded_totals_are_those_of_the_full_view() -> None:
    raw = export.load(RECORDED)
    view = model_view(raw)
    assert raw.total("py_samples") > 0 and raw.total("cpu_samples") > 0
    assert all(view.total(m) == raw.total(m) for m in raw.metrics)
    assert view.node_count < raw.node_count


def test_gpu_profile_opens_on_gpu_time_in_the_model_view(tmp_path, capsys) -> None:
    path = tmp_path / "gpu.json"
    export.save(gpt2_snapshot(), path)
    text = report(capsys, "--input", str(path))
    tree = text.split("\n\n", 1)[1]
    assert tree.startswith("gpu_time_ns: total 20.0ms")
    assert "transformer.h.1.mlp.c_fc · Conv1D" in tree and "_call_impl" not in tree


@pytest.mark.parametrize("fmt", ["json", "folded", "speedscope"])
def test_exports_are_full_unless_asked(tmp_path, fmt) -> None:
    full, model = tmp_path / "full", tmp_path / "model"
    args = ["report", "-i", str(RECORDED), "--format", fmt, "--metric", "py_samples"]
    assert cli.main([*args, "-o", str(full)]) == 0
    assert cli.main([*args, "--view", "model", "-o", str(model)]) == 0
    assert "_call_impl" in full.read_text() and "_call_impl" not in model.read_text()
    assert "transformer.h.0.attn" in model.read_text()
    if fmt == "json":
        assert json.loads(model.read_text())["meta"]["view"] == "model"
        assert export.load(model).total("py_samples") == export.load(RECORDED).total("py_samples")
