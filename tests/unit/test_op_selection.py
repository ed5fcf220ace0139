"""Default op probe set: every at::_ops::*::call but the view/metadata ops of VIEW_OPS."""

from __future__ import annotations

import glob
import importlib.util
import os

import pytest

from stacklens.bpf import ProbeConfig
from stacklens.bpf.ops import VIEW_OPS, OpSymbol, find_op_symbols, select_ops

OPS = [OpSymbol(n, i) for i, n in enumerate(
    ("aten::addmm", "aten::as_strided", "aten::linear", "aten::resolve_conj", "aten::t", "aten::item",
     "aten::reshape", "aten::transpose_int", "aten::transpose_copy_int"))]


def _names(ops):
    return [o.name for o in ops]


def test_default_skips_view_ops_all_ops_keeps_them():
    assert _names(select_ops(OPS)) == ["aten::addmm", "aten::linear", "aten::item", "aten::reshape",
                                       "aten::transpose_copy_int"]
    assert select_ops(OPS, all_ops=True) == OPS
    # an explicit regex picks from every op, view ops included
    assert _names(select_ops(OPS, r"^aten::t$")) == ["aten::t"]
    assert _names(select_ops(OPS, r"transpose")) == ["aten::transpose_int", "aten::transpose_copy_int"]


def test_ops_that_copy_sync_or_read_data_stay_probed():
    keep = {"reshape", "reshape_as", "flatten_using_ints", "contiguous", "clone", "copy_", "_to_copy",
            "to_dtype", "item", "_local_scalar_dense", "is_nonzero", "nonzero", "narrow_Tensor",
            "narrow_copy", "tensor_split_tensor_indices_or_sections", "index_Tensor", "index_select",
            "masked_select", "unbind_int", "split_Tensor", "chunk", "is_pinned", "set_data", "_conj_physical",
            "conj_physical", "t_copy", "view_copy", "as_strided_copy", "expand_copy", "select_copy_int"}
    assert not {"aten::" + k for k in keep} & VIEW_OPS


def test_probe_config_all_ops(monkeypatch):
    monkeypatch.delenv("STACKLENS_ALL_OPS", raising=False)
    assert ProbeConfig().all_ops is False
    assert ProbeConfig(all_ops=True).all_ops is True
    monkeypatch.setenv("STACKLENS_ALL_OPS", "1")
    assert ProbeConfig().all_ops is True
    monkeypatch.setenv("STACKLENS_ALL_OPS", "0")
    assert ProbeConfig().all_ops is False


def test_every_view_op_is_exported_by_this_libtorch():
    spec = importlib.util.find_spec("torch")  # located, not imported
    if spec is None or not spec.origin:
        pytest.skip("torch not installed")
    libs = glob.glob(os.path.join(os.path.dirname(spec.origin), "lib", "libtorch_cpu.so*"))
    if not libs:
        pytest.skip("no libtorch_cpu.so next to torch")
    names = {o.name for o in find_op_symbols(libs[0], use_disk_cache=False)}
    assert VIEW_OPS <= names, sorted(VIEW_OPS - names)
