"""The copies analysis itself (tests/gpu/copies.py) on synthetic trees: runs anywhere."""

from __future__ import annotations

from stacklens.cct import CCT, Frame
from tests.gpu.copies import analyze, checks, truth_label

FILE = "/x/tests/targets/gpu_copies.py"
MAIN = (Frame.python(FILE, "main", 120), Frame.python(FILE, "step", 90))
K = 100


def prof(events):
    return {"events": {n: {"cat": c, "count": k, "dur_ns": d} for n, (c, k, d) in events.items()}}


PROF = {"cp_h2d_pageable": [prof({"Memcpy HtoD (Pageable -> Device)": ("gpu_memcpy", K, K * 700_000)}),
                            prof({"Memcpy HtoD (Pageable -> Device)": ("gpu_memcpy", K, K * 710_000)})],
        "ms_memset": [prof({"Memset (Device)": ("gpu_memset", K, K * 9_000),
                            "void at::native::fill": ("kernel", 1, 5)})] * 2}


def tree(h2d_ns=705_000, unjoined=0):
    t = CCT(metrics=("gpu_time_ns", "memcpy_count", "memset_count", "copy_bytes"))
    h = MAIN + (Frame.python(FILE, "cp_h2d_pageable", 70), Frame.op("aten::copy_"),
                Frame.api("cuMemcpyAsync"), Frame.memcpy("HtoD (Pageable -> Device)"))
    t.add_many(h, {"memcpy_count": K, "gpu_time_ns": K * h2d_ns})
    m = MAIN + (Frame.python(FILE, "ms_memset", 82), Frame.api("cuMemsetD32Async"), Frame.memset("Device"))
    t.add_many(m, {"memset_count": K, "gpu_time_ns": K * 9_100})
    if unjoined:
        t.add_many((Frame.other("[copy call not seen]"), Frame.memcpy("DtoH (Device -> Pageable)")),
                   {"memcpy_count": unjoined, "gpu_time_ns": 5})
    return t.snapshot()


def test_names_map_to_frame_labels():
    assert truth_label("Memcpy DtoH (Device -> Pinned)") == "memcpy:DtoH (Device -> Pinned)"
    assert truth_label("Memset (Device)") == "memset:Device"
    assert truth_label("void kernel()") is None


def test_matching_profile_passes():
    v = checks({"analysis": analyze(tree(), PROF, K)})
    assert all(ok for ok, _ in v.values()), v
    assert "cuMemcpyAsync" in v["cp_h2d_pageable memcpy:HtoD (Pageable -> Device)"][1]


def test_time_off_by_more_than_5pct_and_unjoined_copies_fail():
    v = checks({"analysis": analyze(tree(h2d_ns=800_000, unjoined=3), PROF, K)})
    assert not v["cp_h2d_pageable memcpy:HtoD (Pageable -> Device)"][0]
    assert not v["nothing_unjoined"][0]
    assert v["ms_memset memset:Device"][0]


def test_truth_of_a_label_one_function_owns_comes_from_whole_steps():
    whole = [prof({"Memcpy HtoD (Pageable -> Device)": ("gpu_memcpy", K, K * 705_000),
                   "Memset (Device)": ("gpu_memset", K, K * 12_000)})] * 2
    a = analyze(tree(), PROF, K, whole)
    h2d = a["functions"]["cp_h2d_pageable"]["memcpy:HtoD (Pageable -> Device)"]
    assert h2d["truth_from"] == "same step" and h2d["truth_gpu_time_ns"] == K * 705_000
    assert h2d["truth_alone_ns"] == K * 705_000 and h2d["rel_err"] == 0
    ms = a["functions"]["ms_memset"]["memset:Device"]
    assert ms["truth_from"] == "same step" and not checks({"analysis": a})["ms_memset memset:Device"][0]


def test_a_label_two_functions_produce_keeps_the_truth_alone():
    both = dict(PROF, cp_other=[prof({"Memset (Device)": ("gpu_memset", K, K * 9_000)})] * 2)
    whole = [prof({"Memset (Device)": ("gpu_memset", 2 * K, 2 * K * 12_000)})] * 2
    ms = analyze(tree(), both, K, whole)["functions"]["ms_memset"]["memset:Device"]
    assert ms["truth_from"] == "alone" and ms["truth_gpu_time_ns"] == K * 9_000
