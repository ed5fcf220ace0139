"""CUDA-graph replays split per node (daemon/join/graphs.py), on the kernel records of H200 run 33
(docs/benchmarks/gpu-run33-graphs: a manual torch.cuda.graph of an eager MLP, two graphs, five
replays; cudagraph trees of a compiled transformer) and the join around them."""

from __future__ import annotations

import dataclasses
import gzip
import json
import re
from pathlib import Path

from stacklens.cct import Frame
from stacklens.daemon.join.compiled import InductorIndex
from stacklens.daemon.join.graphs import (BEFORE_ATTACH, BY_INDUCTOR, GRAPH, GraphSplit, align, align_calls, call_family,
                                          kernel_family)
from stacklens.introspect.demangle import demangle
from stacklens.records.agent import KernelRecord
from tests.unit.test_orderjoin import launch, make, settle

RUN33 = Path(__file__).resolve().parents[2] / "docs" / "benchmarks" / "gpu-run33-graphs"
REPLAY = (Frame.python("serve.py", "main", 5), Frame.python("serve.py", "step", 9))


def recorded(case: str) -> list[KernelRecord]:
    d = json.load(gzip.open(RUN33 / f"graph_nodes-{case}.json.gz"))
    return [KernelRecord(name, s, e, 0, stream, corr, (1, 1, 1), (1, 1, 1), graph, node)
            for corr, graph, node, s, e, stream, name in d["kernels"]]


def replays(recs: list[KernelRecord]) -> dict[int, list[KernelRecord]]:
    out: dict[int, list[KernelRecord]] = {}
    for r in recs:
        if r.graph_id:
            out.setdefault(r.correlation_id, []).append(r)
    return out


def replay_through(j, groups) -> None:
    """Each group of kernel records as one graph launch from REPLAY, 10 µs apart, then its records."""
    for k, rs in enumerate(groups):
        j.on_bpf(launch(20_000 + k * 10_000, REPLAY, None, op="aten::replay", kind="graph", api="cuGraphLaunch"))
        for r in rs:
            j.on_agent(r)


def test_align_follows_names_in_order_and_skips_what_is_not_there():
    assert align(["a", "b", "a", "c"], ["a", "b", "x", "a", "c"]) == [0, 1, 3, 4]
    assert align(["z"], ["a"]) == [None]
    assert align(["k", "k"], ["unresolved:0x1", "unresolved:0x2"], lambda n: n.startswith("unresolved:")) == [0, 1]


def test_align_calls_puts_library_kernels_on_the_extern_call_between_triton_neighbours():
    calls = [("triton_a", True), ("extern_kernels.mm", False), ("extern_kernels.addmm", False),
             ("triton_b", True), ("aten._flash_attention", False), ("triton_c", True)]
    got = align_calls(["triton_a", "sgemm", "sgemm", "splitKreduce_kernel", "triton_b", "fmha", "fmha_2", "triton_c"],
                      calls)
    assert got == [0, 1, 2, 2, 3, 4, 4, 5]
    # an attention call's second kernel is not taken for the GEMM call after it, nor the reverse
    calls = [("aten._scaled_dot_product_efficient_attention_backward", False), ("extern_kernels.mm", False)]
    assert align_calls(["fmha_bwd", "fmha_bwd_2", "sgemm"], calls) == [0, 0, 1]
    assert align_calls(["fmha_bwd", "cutlass_sgemm", "cutlass_sgemm"], calls[:1] + calls + calls[1:]) == [0, 2, 3]


def test_manual_graph_captured_while_attached_lands_on_its_captured_lines():
    """The first graph of run 33 (10 kernels a replay): its capture seen by the probes (launches of
    the capturing thread with the kernel names CUPTI gives their handles), then three replays.
    Every replayed kernel lands under [graph] on the line that launched it during capture."""
    j, clock = make()
    recs = recorded("manual")
    first = [rs for rs in replays(recs).values() if rs[0].graph_id == 2]
    order = sorted(first[0], key=lambda r: r.start_ns)
    j.on_bpf(launch(10_000, REPLAY, None, op="", kind="capture", api="cuStreamBeginCapture_v2"))
    for i, r in enumerate(order):
        ev = launch(11_000 + i, (Frame.python("model.py", "forward", 100 + i),), None, op="aten::linear")
        object.__setattr__(ev, "kernel_name", demangle(r.name))
        j.on_bpf(ev)
    j.on_bpf(launch(12_000, REPLAY, None, op="", kind="capture", api="cuStreamEndCapture"))
    replay_through(j, first)
    settle(j, clock)
    snap = j.snapshot()
    total = sum(r.end_ns - r.start_ns for rs in first for r in rs)
    base = [f.label() for f in REPLAY] + ["op:aten::replay", "api:cuGraphLaunch", GRAPH.label()]
    on_lines = 0
    for i, r in enumerate(order):
        n = snap.find(base + [f"py:model.py:forward:{100 + i}", "op:aten::linear", "api:cuLaunchKernel",
                              f"kernel:{demangle(r.name)}"])
        assert n is not None, (i, demangle(r.name))
        on_lines += snap.exclusive(n, "gpu_time_ns")
    assert on_lines == total
    meta = snap.meta["graphs"]
    assert meta["graphs_by_capture"] == 1 and meta["nodes_by_capture"] == 10
    assert j.stats.launches_unmatched == 0      # captured launches never wait for a kernel


def test_graph_captured_before_attach_is_named_under_the_marker_never_on_a_line():
    j, clock = make()
    recs = recorded("manual")
    replay_through(j, replays(recs).values())
    settle(j, clock)
    snap = j.snapshot()
    graph_ns = sum(r.end_ns - r.start_ns for r in recs if r.graph_id)
    marker = snap.find([f.label() for f in REPLAY] + ["op:aten::replay", "api:cuGraphLaunch", BEFORE_ATTACH.label()])
    assert snap.inclusive(marker, "gpu_time_ns") == graph_ns
    kernels = {snap.frame_of(c).name for c in snap.children(marker)}
    assert kernels == {demangle(r.name) for r in recs if r.graph_id}
    assert snap.meta["graphs"]["nodes_named_only"] == snap.meta["graphs"]["nodes_known"]


def split_all(split: GraphSplit, recs: list[KernelRecord]) -> list:
    """Each record through `split` as a replay launched from REPLAY, then the held ones."""
    launch_path = REPLAY + (Frame.api("cuGraphLaunch"),)
    got = []
    for r in recs:
        got.extend(split.kernel(launch_path, r))
    return got + split.flush()


def test_node_contexts_are_decided_once_and_reused_across_replays():
    recs = [r for r in recorded("manual") if r.graph_id == 2]
    split = GraphSplit(demangle, lambda: None)
    got = split_all(split, recs)
    assert len(got) == len(recs)
    assert split.waiting() == 0
    by_node = {}
    for p, r in got:
        by_node.setdefault(r.graph_node_id, set()).add(id(p))
    assert all(len(ids) == 1 for ids in by_node.values())     # one path object per node
    assert split.meta()["nodes_known"] == 10


def test_a_graph_matched_to_nothing_is_bound_once_even_without_node_ids():
    """Records without a node id are never memoized: every replay is held and settled, but the
    graph is matched once (an unknown graph is tried again only after forget_unknown)."""
    recs = [dataclasses.replace(r, graph_node_id=0) for r in recorded("manual") if r.graph_id == 2]
    split = GraphSplit(demangle, lambda: None)
    assert len(split_all(split, recs)) == len(recs) and len(replays(recs)) > 1
    assert split.meta()["graphs_unknown"] == 1 and split.meta()["graphs"] == 1
    split.forget_unknown()
    split_all(split, recs[:1])
    assert split.meta()["graphs_unknown"] == 2


RUN34 = Path(__file__).resolve().parents[2] / "docs" / "benchmarks" / "gpu-run34-graphs"


def test_cudagraph_tree_replays_align_with_the_calls_of_their_wrapper_module():
    """Run 34: the forward and backward wrappers of a four-block transformer under
    mode="reduce-overhead" (torch 2.11 keeps no line map for them: the kernel calls sit in
    ``partition_0``), read as the agent sends them, and two steps' replays (34 and 127 kernels).
    Each replay finds its module by its Triton names, and every replayed kernel a call of it;
    Triton kernels the call of their own name."""
    from stacklens.inject.agent.inductor import chunks, module_rows
    from stacklens.inject.channel.inductor import parse_inductor

    d = json.load(gzip.open(RUN34 / "graph_nodes-inductor.json.gz"))
    index = InductorIndex()
    for path, text in d["codecache"]["files"].items():
        if "def call(" not in text:
            continue
        parts = chunks(module_rows(text, (), (), []))
        for i, rows in enumerate(parts):
            index.add(parse_inductor({"t": "inductor", "path": path, "part": i, "parts": len(parts), "r": rows}))
    assert index.meta()["modules"] == 2
    recs = [KernelRecord(name, s, e, 0, stream, corr, (1, 1, 1), (1, 1, 1), graph, node)
            for corr, graph, node, s, e, stream, name in d["kernels"]]
    seen_modules = set()
    for rs in replays(recs).values():
        rs.sort(key=lambda r: r.start_ns)
        names = [demangle(r.name) for r in rs]
        mod = index.best_module(names)
        seen_modules.add(mod)
        calls, _tails = index.calls(mod)
        pos = align_calls(names, calls)
        assert None not in pos
        for n, p in zip(names, pos):
            if n.startswith("triton_"):
                assert calls[p][0] == n
            else:
                assert not calls[p][1]            # a library kernel on an extern call
                kf, cf = kernel_family(n), call_family(calls[p][0])
                assert kf is None or cf is None or kf == cf, (n, calls[p][0])   # 8 GEMMs went to the
                                                  # attention backward call before families were read
    assert len(seen_modules) == 2


def test_a_wrapper_without_a_line_map_charges_each_call_to_its_own_nodes_line():
    """Rule "no line map" (daemon/join/compiled.py): a Triton call takes the last node of its
    subgraph with a line, the k-th call of a library op the node FX named for it (addmm, addmm_1)."""
    from stacklens.daemon.join.compiled import build_map

    lines = [(1, "# AOT ID: ['0_forward']"),
             (2, "# Topologically Sorted Source Nodes: [layer_norm], Original ATen: [aten.native_layer_norm]"),
             (3, "#   %var_mean : [num_users=2] = call_function[target=torch.ops.aten.var_mean.correction](args)"),
             (4, "#   %add_1 : Tensor \"f32[8]\"[num_users=1] = call_function[target=torch.ops.aten.add.Tensor](args)"),
             (5, "triton_per_fused_ln_0 = async_compile.triton('triton_per_fused_ln_0', '''"),
             (10, "def partition_0(args):"),
             (11, "        triton_per_fused_ln_0.run(buf3, primals_1, stream=stream0)"),
             (12, "        extern_kernels.addmm(primals_5, buf4, primals_4, alpha=1, beta=1, out=buf5)"),
             (13, "        extern_kernels.addmm(primals_7, buf6, primals_6, alpha=1, beta=1, out=buf7)"),
             (14, "        buf8 = torch.ops.aten._scaled_dot_product_efficient_attention.default(buf5, None)"),
             (20, "def call(self, args):"),
             (21, "        (buf0, ) = self.partitions[0](partition0_args)")]
    nodes = [("var_mean", "model.py", 27, "forward"), ("add_1", "model.py", 28, "forward"),
             ("addmm", "model.py", 27, "forward"), ("addmm_1", "model.py", 30, "forward"),
             ("_scaled_dot_product_efficient_attention", "model.py", 29, "forward")]
    m = build_map("w.py", lines, [], [], nodes)
    got = {ln: (m.at(ln)[0][-1].line, m.at(ln)[1]) for ln in (11, 12, 13, 14)}
    assert got == {11: (28, "triton_per_fused_ln_0"), 12: (27, "extern_kernels.addmm"),
                   13: (30, "extern_kernels.addmm"), 14: (29, "aten._scaled_dot_product_efficient_attention")}


def test_a_backward_library_call_takes_the_node_its_comment_names_not_the_kth():
    """Run 34's backward wrapper calls ``mm_1`` before ``mm`` (its comments name them): the node
    the comment names wins over FX's k-th-of-an-op order."""
    from stacklens.daemon.join.compiled import build_map

    lines = [(1, "# AOT ID: ['0_backward']"),
             (10, "def partition_0(args):"),
             (11, "    # Topologically Sorted Source Nodes: [permute_33, mm_1], Original ATen: [aten.t, aten.mm]"),
             (12, "    extern_kernels.mm(buf0, view_46, out=buf2)"),
             (13, "    # Topologically Sorted Source Nodes: [linear_15, permute_32, mm], Original ATen: [aten.t, aten.mm]"),
             (14, "    extern_kernels.mm(buf0, primals_48, out=buf1)"),
             (20, "def call(self, args):")]
    nodes = [("mm", "model.py", 36, "forward"), ("mm_1", "model.py", 32, "forward"),
             ("permute_33", "model.py", 40, "forward")]
    m = build_map("w.py", lines, [], [], nodes)
    assert (m.at(12)[0][-1].line, m.at(14)[0][-1].line) == (32, 36)


def test_graphs_replayed_before_their_inductor_module_arrived_are_matched_again_after():
    """The agent sends Inductor's modules after it attached, while replays already run: the
    graphs matched to nothing meanwhile are matched again at their next replay."""
    from stacklens.inject.agent.inductor import chunks, module_rows
    from stacklens.inject.channel.inductor import parse_inductor

    d = json.load(gzip.open(RUN34 / "graph_nodes-inductor.json.gz"))
    recs = [KernelRecord(name, s, e, 0, stream, corr, (1, 1, 1), (1, 1, 1), graph, node)
            for corr, graph, node, s, e, stream, name in d["kernels"]]
    first, second = [], []
    for rs in replays(recs).values():
        (second if any(r.graph_id == rs[0].graph_id for r in first) else first).extend(rs)
    index = InductorIndex()
    split = GraphSplit(demangle, lambda: index if index.modules else None)
    launch_path = REPLAY + (Frame.api("cuGraphLaunch"),)
    got = [c for r in first for c in split.kernel(launch_path, r)] + split.flush()
    assert {p[len(launch_path)] for p, _r in got} == {BEFORE_ATTACH}
    for path, text in d["codecache"]["files"].items():
        if "def call(" in text:      # post-grad nodes at made-up lines of model.py (run 34 sent none)
            names = dict.fromkeys(re.findall(r"#\s+%(\w+) : .*= call_function\[", text))
            nodes = [(n, "model.py", 10 + k, "forward") for k, n in enumerate(names)]
            parts = chunks(module_rows(text, (), (), nodes))
            for i, rows in enumerate(parts):
                index.add(parse_inductor({"t": "inductor", "path": path, "part": i, "parts": len(parts), "r": rows}))
    split.forget_unknown()
    got = [c for r in second for c in split.kernel(launch_path, r)] + split.flush()
    assert len(got) == len(second)
    assert {p[len(launch_path)] for p, _r in got} == {BY_INDUCTOR, BEFORE_ATTACH}
    assert split.meta()["graphs_by_inductor"] == 2
