"""cct/labels.py: the one naming of frames and contexts (TUI hotspots, text report, Prometheus labels)."""

from __future__ import annotations

from stacklens.cct import Frame
from stacklens.cct.labels import METRIC_LABEL, ON_SCREEN, context_label, frame_text

PY = Frame.python("/a/b/model.py", "forward", 17)
OUTER = Frame.python("/a/train.py", "step", 3)
OP = Frame.op("aten::linear")


def test_context_rules_innermost_python_and_op_then_leaf_in_both_styles():
    path = (OUTER, Frame.op("aten::outer"), PY, OP, Frame.kernel("x" * 500))
    up = list(reversed(path))
    # the Prometheus label: public, bounded, the leaf named when it is neither python nor op
    label = context_label(up, METRIC_LABEL)
    assert label.startswith("model.py:forward:17 > aten::linear > kernel:" + "x" * 40)
    assert len(label) <= 120
    assert context_label(reversed((PY, Frame.native("/usr/lib/libc.so.6", "memcpy")))) == (
        "model.py:forward:17 > native:/usr/lib/libc.so.6:memcpy")
    long = Frame.python("/" + "d" * 300 + ".py", "f", 1)
    assert len(context_label([long])) == 120 and context_label([long]).endswith("…")
    assert context_label([], METRIC_LABEL) == "[root]"
    # on screen: the same parts, the leaf left to the frame column, unbounded
    assert context_label(up, ON_SCREEN) == "forward  model.py:17 › aten::linear"
    assert context_label([], ON_SCREEN) == ""
    # a python or op leaf is its own part, not named twice
    assert context_label([PY, OUTER]) == "model.py:forward:17"
    assert context_label([OP, OUTER], ON_SCREEN) == "step  train.py:3 › aten::linear"


def test_frame_text_short_and_full():
    assert frame_text(PY) == "forward  model.py:17"
    assert frame_text(PY, full=True) == "py:/a/b/model.py:forward:17"
    assert frame_text(Frame.native("/usr/lib/libc.so.6", "memcpy")) == "memcpy [libc.so.6]"
    assert frame_text(Frame.other("truncated")) == "[truncated]"
    assert frame_text(Frame.kernel("k")) == "k" and frame_text(Frame.kernel("k"), full=True) == "kernel:k"
    for full in (False, True):
        assert frame_text(Frame.module("transformer.h.3.attn", "GPT2Attention"), full=full) == (
            "transformer.h.3.attn · GPT2Attention")
