"""Frame constructors and text labels."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from stacklens.cct import Frame

text = st.text(st.characters(blacklist_categories=("Cs",)), max_size=20)
lines = st.integers(min_value=-5, max_value=10**6)

frames = st.one_of(
    st.builds(Frame.python, text, text, lines),
    st.builds(Frame.op, text),
    st.builds(Frame.native, text, text),
    st.builds(Frame.api, text),
    st.builds(Frame.kernel, text),
    st.builds(Frame.instruction, text),
    st.builds(Frame.other, text),
    st.builds(Frame.module, text, text),
)


@pytest.mark.parametrize(
    ("frame", "label"),
    [
        (Frame.python("/srv/train.py", "step", 42), "py:/srv/train.py:step:42"),
        (Frame.python("C:/x.py", "Model.forward", 7), "py:C:/x.py:Model.forward:7"),
        (Frame.op("aten::addmm"), "op:aten::addmm"),
        (Frame.native("libtorch_cuda.so", "at::native::gemm<float>(char, long)"),
         "native:libtorch_cuda.so:at::native::gemm<float>(char, long)"),
        (Frame.native("", "::global"), "native::::global"),
        (Frame.api("cuLaunchKernel"), "api:cuLaunchKernel"),
        (Frame.kernel("void cutlass::Kernel<T>(P)"), "kernel:void cutlass::Kernel<T>(P)"),
        (Frame.instruction("HMMA.16816"), "insn:HMMA.16816"),
        (Frame.other("[truncated]"), "[truncated]"),
        (Frame.other("other"), "[other]"),
        (Frame.python("a.py", "odd:name%", 1), "py:a.py:odd%3Aname%25:1"),
        (Frame.native("weird:lib", "f"), "native:weird%3Alib:f"),
        (Frame.module("transformer.h.3.attn", "GPT2Attention"), "module:GPT2Attention:transformer.h.3.attn"),
        (Frame.module("", "GPT2LMHeadModel"), "module:GPT2LMHeadModel:"),
        (Frame.module("blocks.a:b", "odd:Class"), "module:odd%3AClass:blocks.a:b"),
    ],
)
def test_label(frame: Frame, label: str) -> None:
    assert frame.label() == label
    assert Frame.from_label(label) == frame


def test_fields_and_kinds() -> None:
    assert Frame.python("f.py", "g", 3) == Frame("python", "g", "f.py", 3)
    assert Frame.native("libc.so.6", "memcpy") == Frame("native", "memcpy", "libc.so.6", 0)
    assert Frame.api("cudaMemcpyAsync").kind == "gpu_api"
    assert Frame.other("[x]") == Frame.other("x") == Frame("other", "x")


@given(frames)
def test_label_round_trip(frame: Frame) -> None:
    assert Frame.from_label(frame.label()) == frame


@pytest.mark.parametrize("label", ["", "aten::addmm", "py:a.py:f", "py:a.py:f:x", "native:nolib", "module:nopath", "[open", "zz:x"])
def test_from_label_rejects(label: str) -> None:
    with pytest.raises(ValueError):
        Frame.from_label(label)
