"""Strict parsing of what an agent sends (everything from the target is hostile)."""

import pytest

from stacklens.records.agent import ApiRecord, KernelRecord, MemcpyRecord, Note, PySample, SyncRecord
from stacklens.inject.channel.messages import parse_message
from stacklens.inject.channel.validate import ProtocolError


def test_samples_share_stacks():
    recs = parse_message({"t": "samples", "stacks": [[["a.py", "main", 1], ["a.py", "f", 7]]],
                          "s": [[10, 100, 0, 0], [11, 101, 0, 1]]})
    assert recs == [PySample(10, 100, (("a.py", "main", 1), ("a.py", "f", 7)), False),
                    PySample(11, 101, (("a.py", "main", 1), ("a.py", "f", 7)), True)]


def test_sample_frames_may_name_a_module_call():
    stack = [["a.py", "main", 1], ["gpt2.py", "GPT2Attention.forward", 7, "transformer.h.3.attn", "GPT2Attention"]]
    [rec] = parse_message({"t": "samples", "stacks": [stack], "s": [[10, 100, 0, 0]]})
    assert rec.frames == (("a.py", "main", 1), ("gpt2.py", "GPT2Attention.forward", 7, "transformer.h.3.attn",
                                                  "GPT2Attention"))
    # the names are cut and escaped like every string from the target
    [rec] = parse_message({"t": "samples", "stacks": [[["a.py", "f", 1, "x" * 5000, "C\x1b[2J"]]], "s": [[1, 2, 0, 0]]})
    assert len(rec.frames[0][3]) <= 512 and "\x1b" not in rec.frames[0][4]
    for bad in (["a.py", "f", 1, "p"], ["a.py", "f", 1, "p", 7], ["a.py", "f", 1, "p", "C", "x"]):
        with pytest.raises(ProtocolError):
            parse_message({"t": "samples", "stacks": [[bad]], "s": []})
    # only samples name modules: a compile record's call site stays (file, name, line)
    with pytest.raises(ProtocolError):
        parse_message({"t": "compile", "r": [["/jax/x", "jit(f)", 1, 2, 3, [["a.py", "f", 1, "p", "C"]]]]})


def test_gpu_rows():
    assert parse_message({"t": "kernel", "r": [["k", 1, 5, 0, 7, 3, 1, 2, 3, 4, 5, 6, 0]]}) == [
        KernelRecord("k", 1, 5, 0, 7, 3, (1, 2, 3), (4, 5, 6), 0)]
    # kernel names once per message, rows by index (what the agent sends)
    assert parse_message({"t": "kernel", "n": ["void a<int>()", "gemm"],
                          "r": [[1, 1, 5, 0, 7, 3, 1, 2, 3, 4, 5, 6, 0], [0, 6, 9, 0, 7, 4, 1, 1, 1, 1, 1, 1, 0]]}) == [
        KernelRecord("gemm", 1, 5, 0, 7, 3, (1, 2, 3), (4, 5, 6), 0),
        KernelRecord("void a<int>()", 6, 9, 0, 7, 4, (1, 1, 1), (1, 1, 1), 0)]
    assert parse_message({"t": "api", "r": [["runtime", "cudaLaunchKernel", 5, 1, 2, 3, 211]]}) == [
        ApiRecord("runtime", "cudaLaunchKernel", 5, 1, 2, 3, 211)]
    assert parse_message({"t": "memcpy", "r": [["HtoD", 4096, 1, 2, 0, 7, 9]]}) == [
        MemcpyRecord("HtoD", 4096, 1, 2, 0, 7, 9)]
    assert parse_message({"t": "sync", "r": [["stream", 1, 9, 7, 4]]}) == [SyncRecord("stream", 1, 9, 7, 4)]
    assert parse_message({"t": "note", "level": "info", "msg": "hi", "t_ns": 5}) == [Note("info", "hi", 5)]


@pytest.mark.parametrize("msg", [
    None, [], "x", {"t": "exec", "code": "1"}, {"t": "samples"},
    {"t": "samples", "stacks": [[["f", "g", -1]]], "s": [[1, 2, 0, 0]]},
    {"t": "samples", "stacks": [], "s": [[1, 2, 0, 0]]},
    {"t": "samples", "stacks": [[["f", "g", 1]]], "s": [[1, 2, 0, 2]]},
    {"t": "samples", "stacks": [[["f", "g", True]]], "s": [[1, 2, 0, 0]]},
    {"t": "samples", "stacks": [[[7, "g", 1]]], "s": []},      # long strings are cut: test_target_strings.py
    {"t": "samples", "stacks": [[["f", "g", 1]] * 300], "s": []},
    {"t": "kernel", "r": [["k", 10, 5, 0, 0, 0, 1, 1, 1, 1, 1, 1, 0]]},
    {"t": "kernel", "r": [["k", 1.5, 5, 0, 0, 0, 1, 1, 1, 1, 1, 1, 0]]},
    {"t": "kernel", "r": [["k", 1, 5, 0, 0, 0, 1, 1, 1, 1, 1, 1]]},
    {"t": "kernel", "n": ["k"], "r": [[1, 1, 5, 0, 0, 0, 1, 1, 1, 1, 1, 1, 0]]},     # index out of range
    {"t": "kernel", "n": ["k"], "r": [[-1, 1, 5, 0, 0, 0, 1, 1, 1, 1, 1, 1, 0]]},
    {"t": "kernel", "r": [[0, 1, 5, 0, 0, 0, 1, 1, 1, 1, 1, 1, 0]]},                 # index without a table
    {"t": "kernel", "n": [7], "r": [[0, 1, 5, 0, 0, 0, 1, 1, 1, 1, 1, 1, 0]]},
    {"t": "kernel", "n": "k", "r": []},
    {"t": "api", "r": [["evil", "x", 1, 1, 2, 3, 4]]},
    {"t": "memcpy", "r": [["HtoD", 2 ** 70, 1, 2, 0, 0, 0]]},
    {"t": "memcpy", "r": [["sideways", 1, 1, 2, 0, 0, 0]]},
    {"t": "sync", "r": [["stream", 1, 2, 0]]},
    {"t": "note", "level": "critical", "msg": "x"},
    {"t": "stats", "samples": 1, "sample_hz": float("nan"), "sample_cost_us": 1},
    {"t": "stats", "samples": -1, "sample_hz": 1, "sample_cost_us": 1},
    {"t": "kernel", "r": [["k", 1, 2, 0, 0, 0, 1, 1, 1, 1, 1, 1, 0]] * 20001},
])
def test_rejects(msg):
    with pytest.raises((ProtocolError, TypeError, ValueError)):
        parse_message(msg)
