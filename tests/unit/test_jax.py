"""JAX (issue 10): HLO source maps, fusion split, compile time on the call site — no GPU.

The HLO and compile tests run real CPU JAX in this process (skipped without jax); the split and
join tests use synthetic records.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from stacklens.cct import Frame
from stacklens.daemon.join.jaxjoin import JaxIndex, sanitize, split_paths
from stacklens.daemon.join.joiner import Joiner
from stacklens.inject.agent import heapscan
from stacklens.inject.agent.jaxmeta import JaxWatcher, parse_hlo_text
from stacklens.records.agent import ApiRecord, CompileRecord, HloKernel, HloMapRecord, KernelRecord
from stacklens.inject.channel.messages import parse_message
from stacklens.inject.channel.validate import ProtocolError
from tests.fakes.sources import FakeEvent, py

TARGETS = Path(__file__).resolve().parents[1] / "targets"


def marker_line(file: str, marker: str) -> int:
    for i, line in enumerate((TARGETS / file).read_text().splitlines(), 1):
        if marker in line:
            return i
    raise AssertionError(marker)


# ---- HLO text parsing (synthetic: the older inline source_file/source_line metadata) ----------

OLD_HLO = """HloModule jit_train, is_scheduled=true

%fused_inner (p0: f32[4]) -> f32[4] {
  %p0 = f32[4]{0} parameter(0)
  ROOT %neg.1 = f32[4]{0} negate(%p0), metadata={op_name="jit(train)/neg" source_file="/m/a.py" source_line=7}
}

%fused_computation.2 (param_0: f32[4], param_1: f32[4]) -> f32[4] {
  %param_0 = f32[4]{0} parameter(0)
  %param_1 = f32[4]{0} parameter(1)
  %inner = f32[4]{0} fusion(%param_0), kind=kLoop, calls=%fused_inner
  %add.3 = f32[4]{0} add(%inner, %param_1), metadata={op_name="jit(train)/add" source_file="/m/a.py" source_line=8}
  ROOT %mul.4 = f32[4]{0} multiply(%add.3, %add.3), metadata={op_name="jit(train)/mul" source_file="/m/a.py" source_line=8}
}

%body (t: (s32[], f32[4])) -> (s32[], f32[4]) {
  %t = (s32[], f32[4]{0}) parameter(0)
  %x = f32[4]{0} get-tuple-element(%t), index=1
  %loop_sin_fusion = f32[4]{0} fusion(%x), kind=kLoop, calls=%fused_inner, metadata={op_name="jit(train)/while/body/sin" source_file="/m/b.py" source_line=3}
  %i = s32[] get-tuple-element(%t), index=0
  ROOT %r = (s32[], f32[4]{0}) tuple(%i, %loop_sin_fusion)
}

%cond (t.1: (s32[], f32[4])) -> pred[] {
  %t.1 = (s32[], f32[4]{0}) parameter(0)
  %i.1 = s32[] get-tuple-element(%t.1), index=0
  %c = s32[] constant(3)
  ROOT %lt = pred[] compare(%i.1, %c), direction=LT
}

ENTRY %main.9 (a: f32[4], b: f32[4]) -> f32[4] {
  %a = f32[4]{0} parameter(0), metadata={op_name="a"}
  %b = f32[4]{0} parameter(1), metadata={op_name="b"}
  %loop_add_fusion.2 = f32[4]{0} fusion(%a, %b), kind=kLoop, calls=%fused_computation.2, metadata={op_name="jit(train)/add" source_file="/m/a.py" source_line=8}
  %cublas-gemm.1 = (f32[4]{0}, s8[0]{0}) custom-call(%loop_add_fusion.2, %b), custom_call_target="__cublas$gemm", metadata={op_name="jit(train)/dot_general" source_file="/m/a.py" source_line=9}
  %w = (s32[], f32[4]{0}) while(%cublas-gemm.1), condition=%cond, body=%body
  ROOT %out = f32[4]{0} get-tuple-element(%w), index=1
}
"""


def test_parse_inline_metadata_nested_fusions_and_while_bodies():
    module, entries = parse_hlo_text(OLD_HLO)
    assert module == "jit_train"
    by = {e[0]: e for e in entries}
    # the fusion's ops are those of the instructions inside it, nested fusion included, in order
    assert [tuple(o) for o in by["loop_add_fusion.2"][2]] == [
        ("jit(train)/neg", "/m/a.py", 7, ""), ("jit(train)/add", "/m/a.py", 8, ""), ("jit(train)/mul", "/m/a.py", 8, "")]
    assert by["cublas-gemm.1"][1] == "custom-call"
    assert [tuple(o) for o in by["cublas-gemm.1"][2]] == [("jit(train)/dot_general", "/m/a.py", 9, "")]
    assert "loop_sin_fusion" in by                   # kernels of a while body are indexed too
    # nothing that launches no kernel; schedule order kept (entry first)
    assert [e[0] for e in entries][:2] == ["loop_add_fusion.2", "cublas-gemm.1"]
    assert not {"a", "b", "out", "t", "x", "r"} & set(by)


CMD_BUFFER_HLO = """HloModule jit_step, is_scheduled=true

%fused_a (p0: f32[4]) -> f32[4] {
  %p0 = f32[4]{0} parameter(0)
  ROOT %neg.1 = f32[4]{0} negate(%p0), metadata={op_name="jit(step)/neg" source_file="/m/a.py" source_line=7}
}

%fused_b (p1: f32[4]) -> f32[4] {
  %p1 = f32[4]{0} parameter(0)
  ROOT %exp.1 = f32[4]{0} exponential(%p1), metadata={op_name="jit(step)/exp" source_file="/m/a.py" source_line=9}
}

%command_buffer (a.1: f32[4]) -> f32[4] {
  %a.1 = f32[4]{0} parameter(0)
  %loop_negate_fusion = f32[4]{0} fusion(%a.1), kind=kLoop, calls=%fused_a
  %gemm.1 = (f32[4]{0}, s8[0]{0}) custom-call(%loop_negate_fusion), custom_call_target="__cublas$gemm", metadata={op_name="jit(step)/dot_general" source_file="/m/a.py" source_line=8}
  ROOT %gte = f32[4]{0} get-tuple-element(%gemm.1), index=0
}

%add_reducer (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %add.9 = f32[] add(%x, %y), metadata={op_name="jit(step)/reduce_sum" source_file="/m/a.py" source_line=99}
}

ENTRY %main.3 (a: f32[4]) -> f32[4] {
  %a = f32[4]{0} parameter(0)
  %call.4 = f32[4]{0} call(%a), to_apply=%command_buffer
  %c0 = f32[] constant(0)
  %r = f32[] reduce(%call.4, %c0), dimensions={0}, to_apply=%add_reducer, metadata={op_name="jit(step)/reduce_sum" source_file="/m/a.py" source_line=10}
  ROOT %loop_exp_fusion = f32[4]{0} fusion(%call.4), kind=kLoop, calls=%fused_b
}
"""


def test_parse_inlines_called_computations_command_buffers_in_schedule_order():
    module, entries = parse_hlo_text(CMD_BUFFER_HLO)
    assert module == "jit_step"
    # the command buffer's kernels where the call runs; the call itself and reducers are no entries
    assert [e[0] for e in entries] == ["loop_negate_fusion", "gemm.1", "r", "loop_exp_fusion"]
    by = {e[0]: e for e in entries}
    assert by["gemm.1"][2] == [["jit(step)/dot_general", "/m/a.py", 8, ""]]
    assert by["r"][2] == [["jit(step)/reduce_sum", "/m/a.py", 10, ""]]   # not the reducer's line 99


jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")


@pytest.fixture(scope="module")
def model():
    from tests.targets import jax_step
    return jax_step


def test_hlo_map_of_real_cpu_jax_names_both_source_files(model):
    p = model.params(32)
    x = jnp.ones((8, 32))
    exe = model.step.lower(p, x).compile().runtime_executable()
    module, entries = parse_hlo_text(exe.hlo_modules()[0].to_string())
    assert module == "jit_step"
    ops = {(o[0].rsplit("/", 1)[-1], Path(o[1]).name, o[2]) for e in entries for o in e[2]}
    dense = TARGETS / "jax_dense.py"
    attn = TARGETS / "jax_attention.py"
    assert ("dot_general", dense.name, marker_line(dense.name, "DENSE_MATMUL")) in ops, sorted(ops)
    assert ("max", dense.name, marker_line(dense.name, "DENSE_ACT")) in ops, sorted(ops)
    assert ("dot_general", attn.name, marker_line(attn.name, "ATTN_PROJ")) in ops, sorted(ops)
    assert ("dot_general", attn.name, marker_line(attn.name, "ATTN_VALUES")) in ops, sorted(ops)
    assert ("exp", attn.name, marker_line(attn.name, "ATTN_SOFTMAX")) in ops, sorted(ops)
    # every operator with a location points into one of the two files, with its function
    for e in entries:
        for op_name, f, line, func in e[2]:
            assert op_name.startswith("jit(step)/")
            if f:
                assert f in (str(dense), str(attn), str(TARGETS / "jax_step.py")) and line > 0 and func


def _watch():
    msgs, notes = [], []

    def send(m):
        msgs.append(json.loads(json.dumps(m)))   # through JSON, as on the wire
        return True
    w = JaxWatcher(send, lambda level, m: notes.append((level, m)), scan_existing=False)
    return w, msgs, notes


def _records(msgs):
    out = []
    for m in msgs:
        out.extend(parse_message(m))
    return out


def test_recompilation_charges_compile_time_to_the_triggering_call_site(model):
    w, msgs, notes = _watch()
    w.poll()                                            # starts: listeners registered
    try:
        p = model.params(16)
        model.run_step(p, jnp.ones((5, 16)))            # compile #1 at STEP_CALL
        model.grow(p, 7)                                # new shape: compile #2 at GROW_CALL
        model.grow(p, 7)                                # cached: no compile
        w.poll()
    finally:
        w.stop()
    recs = _records(msgs)
    comp = [r for r in recs if isinstance(r, CompileRecord) and r.fun_name in ("step", "jit(step)")]
    sites = {(r.frames[-1][1], r.frames[-1][2]) for r in comp}
    assert sites == {("run_step", marker_line("jax_step.py", "STEP_CALL")),
                     ("grow", marker_line("jax_step.py", "GROW_CALL"))}, sites
    backend = [r for r in comp if r.event.endswith("backend_compile_duration")]
    assert len(backend) == 2 and all(r.duration_ns > 0 for r in backend)
    assert all(not any("/jax/" in f[0] or "/jaxlib/" in f[0] for f in r.frames) for r in comp)
    # the executables were captured with their call sites
    hlo = [r for r in recs if isinstance(r, HloMapRecord) and r.module == "jit_step"]
    assert {r.site[-1][1] for r in hlo} == {"run_step", "grow"}
    assert all(r.platform == "cpu" for r in hlo)
    # CPU-only JAX: the note says kernel attribution needs a GPU
    assert any("needs a GPU" in m for _lvl, m in notes), notes
    # the listener is gone after stop: later compiles are not seen
    n = len(msgs)
    model.grow(p, 9)
    assert len(msgs) == n

    # daemon side: compile_time_ns lands on the two call sites
    j = Joiner(1, agent=True)
    for r in recs:
        j.on_agent(r)
    snap = j.snapshot()
    assert "compile_time_ns" not in snap.unavailable
    by_leaf = {}
    for path, m in snap.iter_paths():
        if m.get("compile_time_ns"):
            by_leaf[(path[-1].name, path[-1].line)] = by_leaf.get((path[-1].name, path[-1].line), 0) + m["compile_time_ns"]
    assert set(by_leaf) >= {("run_step", marker_line("jax_step.py", "STEP_CALL")),
                            ("grow", marker_line("jax_step.py", "GROW_CALL"))}
    assert sum(by_leaf.values()) == sum(r.duration_ns for r in recs if isinstance(r, CompileRecord))


def test_scan_finds_executables_compiled_before_the_watcher(model, monkeypatch):
    monkeypatch.setattr(heapscan, "MAX_SCAN_BLOCKS", sys.maxsize)   # whatever the suite's heap holds
    p = model.params(12)
    model.run_step(p, jnp.ones((3, 12)))
    msgs, notes = [], []
    w = JaxWatcher(lambda m: msgs.append(m) or True, lambda *a: notes.append(a))
    w.poll()
    w.stop()
    hlo = [r for r in _records(msgs) if isinstance(r, HloMapRecord) and r.module == "jit_step"]
    assert hlo and all(r.site == () for r in hlo)


# ---- wire schema -------------------------------------------------------------------------------

def test_server_schema_accepts_hlo_and_compile_and_rejects_malformed():
    good = {"t": "hlo", "id": "fp1", "module": "jit_f", "platform": "cuda", "part": 0, "parts": 1,
            "site": [["/a.py", "main", 3]], "k": [["fusion.1", "fusion", [["jit(f)/add", "/a.py", 4, "f"]]]]}
    (r,) = parse_message(good)
    assert r == HloMapRecord("fp1", "jit_f", "cuda", 0, 1, (("/a.py", "main", 3),),
                             (HloKernel("fusion.1", "fusion", (("jit(f)/add", "/a.py", 4, "f"),)),))
    for bad in ({**good, "part": 1}, {**good, "parts": 0}, {**good, "k": [["x", "fusion"]]},
                {**good, "k": [["x", "fusion", [["op", "/a.py", -1, ""]]]]}, {**good, "id": 5},
                {**good, "k": [["x", "fusion", [["op", "/a.py", 1, ""]] * 65]]}):
        with pytest.raises((ProtocolError, TypeError, ValueError)):
            parse_message(bad)
    c = {"t": "compile", "r": [["/jax/core/compile/backend_compile_duration", "jit(f)", 10, 5, 7, [["/a.py", "m", 1]]]]}
    (cr,) = parse_message(c)
    assert cr == CompileRecord("/jax/core/compile/backend_compile_duration", "jit(f)", 10, 5, 7, (("/a.py", "m", 1),))
    for bad in ({"t": "compile", "r": [["/torch/x", "f", 1, 1, 1, []]]},
                {"t": "compile", "r": [["/jax/x", "f", 1, -1, 1, []]]},
                {"t": "compile", "r": [["/jax/x", "f", 1, 1, 1, [["/a.py", "m"]]]]}):
        with pytest.raises((ProtocolError, TypeError, ValueError)):
            parse_message(bad)


# ---- the split (synthetic records) -----------------------------------------------------------

DOT = ("jit(step)/dot_general", "/m/dense.py", 7, "dense")
ACT = ("jit(step)/max", "/m/dense.py", 8, "dense")
QK = ("jit(step)/dot_general", "/m/attn.py", 8, "attention")
EXP = ("jit(step)/exp", "/m/attn.py", 9, "attention")
SITE = (("/m/train.py", "main", 20), ("/m/train.py", "run_step", 12))


def hlo_record(mid="fp", module="jit_step", kernels=None, part=0, parts=1):
    kernels = kernels if kernels is not None else [
        HloKernel("loop_maximum_fusion.1", "fusion", (DOT, ACT)),
        HloKernel("cublas-gemm.2", "custom-call", (QK,)),
        HloKernel("input_exp_reduce_fusion", "fusion", (EXP,)),
    ]
    return HloMapRecord(mid, module, "cuda", part, parts, SITE, tuple(kernels))


def krec(name, dur, corr=1, stream=7, start=1000):
    return KernelRecord(name=name, start_ns=start, end_ns=start + dur, device=0, stream=stream, correlation_id=corr)


def test_split_paths_even_with_remainder_and_count_on_first():
    head = (py("main", 20), py("run_step", 12))
    tail = (Frame.native("libjax.so", "Execute"), Frame.api("cuLaunchKernel"))
    out = split_paths(head + tail + (Frame.kernel("k"),), "k", 1001, (DOT, ACT, ("jit(step)/x", "", 0, "")))
    assert [m for _p, m in out] == [{"gpu_time_ns": 335, "kernel_count": 1},
                                    {"gpu_time_ns": 333, "kernel_count": 0},
                                    {"gpu_time_ns": 333, "kernel_count": 0}]
    assert out[0][0] == head + (Frame.python("/m/dense.py", "dense", 7), Frame.op(DOT[0])) + tail + (Frame.kernel("k"),)
    assert out[2][0] == head + (Frame.op("jit(step)/x"),) + tail + (Frame.kernel("k"),)   # no source known
    assert split_paths(head, "k", 10, ()) == [(head + (Frame.kernel("k"),), {"gpu_time_ns": 10, "kernel_count": 1})]


def test_index_matches_sanitized_names_order_rule_and_parts():
    ix = JaxIndex()
    recs = [hlo_record(part=0, parts=2, kernels=[HloKernel("loop_maximum_fusion.1", "fusion", (DOT, ACT))]),
            hlo_record(part=1, parts=2, kernels=[HloKernel("cublas-gemm.2", "custom-call", (QK,)),
                                                 HloKernel("input_exp_reduce_fusion", "fusion", (EXP,))])]
    ix.add_hlo(recs[1])
    assert ix.resolve("loop_maximum_fusion_1") is None          # incomplete module: not used yet
    ix.add_hlo(recs[0])
    site = tuple(Frame.python(*f) for f in SITE)
    a = ix.split(site, krec("loop_maximum_fusion_1", 100))
    assert [p[-3:] for p, _m in a] == [
        (Frame.python("/m/dense.py", "dense", 7), Frame.op(DOT[0]), Frame.kernel("loop_maximum_fusion_1")),
        (Frame.python("/m/dense.py", "dense", 8), Frame.op(ACT[0]), Frame.kernel("loop_maximum_fusion_1"))]
    assert [m["gpu_time_ns"] for _p, m in a] == [50, 50]
    # a cuBLAS kernel right after: charged by launch order to the custom call that follows
    b = ix.split(site, krec("sm90_xmma_gemm_f32f32_tn", 40))
    assert len(b) == 1 and b[0][0][-3:-1] == (Frame.python("/m/attn.py", "attention", 8), Frame.op(QK[0]))
    # on another stream with no previous match: unknown, left alone
    assert ix.split(site, krec("sm90_xmma_gemm_f32f32_tn", 40, stream=9)) is None
    assert ix.split(site, krec("input_exp_reduce_fusion", 30))[0][1] == {"gpu_time_ns": 30, "kernel_count": 1}
    assert ix.split(site, krec("input_exp_reduce_fusion_impl", 30)) is not None
    assert ix.stats["matched"] == 3 and ix.stats["by_order"] == 1 and ix.stats["unmatched"] == 1
    assert sanitize("wrapped_reduce-window.3") == "wrapped_reduce_window_3"


def test_same_name_in_two_modules_prefers_the_module_running_on_the_stream():
    ix = JaxIndex()
    ix.add_hlo(hlo_record("m1", "jit_a", [HloKernel("loop_x", "fusion", (ACT,)), HloKernel("fusion.1", "fusion", (DOT,))]))
    ix.add_hlo(hlo_record("m2", "jit_b", [HloKernel("fusion.1", "fusion", (EXP,))]))
    assert ix.resolve("fusion_1", stream=1)[0].module_id == "m1"   # nothing ran yet: the larger module
    ix.add_hlo(hlo_record("m3", "jit_a", [HloKernel("loop_x", "fusion", (ACT,)), HloKernel("fusion.1", "fusion", (QK,))]))
    assert ix.resolve("fusion_1", stream=2)[0].module_id == "m1"   # m1 ran once
    ix._hits.clear()
    assert ix.resolve("fusion_1", stream=2)[0].module_id == "m3"   # a tie in runs and size: the newest
    ix._forget("m3")
    ix._hits.clear()
    ix.resolve("loop_x")                                          # stream 0/0 now runs jit_a ...
    assert ix.resolve("fusion_1")[0].module_id == "m1"           # ... and fusion.1 comes next in it
    # a new run of jit_a starts on another stream: the module with the most matches (m1: 2, m2: 1)
    assert ix.resolve("fusion_1", stream=3)[0].module_id == "m1"
    # jit_b runs many times elsewhere: it becomes the hot one for a stream that restarts
    for _ in range(5):
        ix._hits["m2"] += 1
    assert ix.resolve("fusion_1", stream=5)[0].module_id == "m2"


def test_joiner_charges_fused_kernels_per_operator_under_the_launch_path():
    j = Joiner(1, agent=True)
    stack = (py("main", 20), py("run_step", 12))
    j.on_agent(hlo_record())
    j.on_bpf(FakeEvent(kind="launch", tid=5, ktime_ns=1_000_000, api="cuLaunchKernel", op_path=(), py_stack=stack,
                       kernel_name="loop_maximum_fusion_1"))
    j.on_agent(ApiRecord("driver", "cuLaunchKernel", 5, 900_000, 1_100_000, 42))
    j.on_agent(krec("loop_maximum_fusion_1", 1000, corr=42))
    snap = j.snapshot()
    base = [f.label() for f in stack]
    n1 = snap.find(base + ["py:/m/dense.py:dense:7", "op:jit(step)/dot_general", "api:cuLaunchKernel",
                           "kernel:loop_maximum_fusion_1"])
    n2 = snap.find(base + ["py:/m/dense.py:dense:8", "op:jit(step)/max", "api:cuLaunchKernel",
                           "kernel:loop_maximum_fusion_1"])
    assert n1 is not None and n2 is not None
    assert snap.inclusive(n1, "gpu_time_ns") == 500 and snap.inclusive(n2, "gpu_time_ns") == 500
    assert snap.total("gpu_time_ns") == 1000 and snap.total("kernel_count") == 1
    assert any("split evenly" in n for n in snap.meta["notes"])
    assert snap.meta["jax"]["matched"] == 1
    assert "compile_time_ns" in snap.unavailable                  # no compile event seen
    # a kernel of no JAX module keeps the plain path
    j.on_bpf(FakeEvent(kind="launch", tid=5, ktime_ns=2_000_000, api="cuLaunchKernel", op_path=(), py_stack=stack))
    j.on_agent(ApiRecord("driver", "cuLaunchKernel", 5, 1_900_000, 2_100_000, 43))
    j.on_agent(krec("my_custom_kernel", 70, corr=43, stream=99))
    snap = j.snapshot()
    assert snap.find(base + ["api:cuLaunchKernel", "kernel:my_custom_kernel"]) is not None


def test_joiner_compile_time_on_call_site():
    j = Joiner(1, agent=True)
    j.on_agent(CompileRecord("/jax/core/compile/backend_compile_duration", "jit(step)", 5, 2_000_000, 9, SITE))
    j.on_agent(CompileRecord("/jax/core/compile/jaxpr_trace_duration", "step", 6, 300, 9, SITE))
    snap = j.snapshot()
    n = snap.find([Frame.python(*f).label() for f in SITE])
    assert snap.exclusive(n, "compile_time_ns") == 2_000_300
    assert "compile_time_ns" not in snap.unavailable


# ---- CUDA graphs (XLA command buffers): kernels with graph_id != 0 --------------------------------

def gkrec(name, dur, graph, stream=7, start=1000):
    return KernelRecord(name=name, start_ns=start, end_ns=start + dur, device=0, stream=stream, correlation_id=1,
                        graph_id=graph)


def test_graph_kernels_resolve_within_their_graph():
    ix = JaxIndex()
    a = [HloKernel("loop_x", "fusion", (ACT,)), HloKernel("fusion.1", "fusion", (DOT,)),
         HloKernel("cublas-gemm.2", "custom-call", (QK,)), HloKernel("fusion.3", "fusion", (EXP,))]
    ix.add_hlo(hlo_record("m1", "jit_a", a))
    ix.add_hlo(hlo_record("m2", "jit_b", [HloKernel("fusion.1", "fusion", (EXP,)), HloKernel("fusion.3", "fusion", (DOT,))]))
    for _ in range(10):                              # jit_b is the hot one outside graphs
        ix._hits["m2"] += 1
    assert ix.split((), gkrec("loop_x", 10, graph=5)) is not None          # only m1 holds it: graph 5 is m1's
    # graph 5's kernels stay in m1, on any stream (concurrent branches), whatever ran most
    assert ix.resolve("fusion_3", stream=11, graph_id=5)[0].module_id == "m1"
    assert ix.resolve("fusion_1", stream=12, graph_id=5)[0].module_id == "m1"
    # a library kernel of the graph: launch order within the graph (previous: fusion.1 of m1)
    m, idxs, rule = ix.resolve("sm90_xmma_gemm_f32f32", stream=13, graph_id=5)
    assert (m.module_id, idxs, rule) == ("m1", [2], "order")
    # another graph with no certain match yet, and non-graph kernels: the usual rules
    assert ix.resolve("fusion_1", stream=3, graph_id=6)[0].module_id == "m2"
    assert ix.resolve("fusion_1", stream=4)[0].module_id == "m2"
    # the graph's kernels through split: the graph id comes from the record
    parts = ix.split((), gkrec("fusion_3", 100, graph=5, stream=14))
    assert [p[-2] for p, _m in parts] == [Frame.op(EXP[0])]
    ix._forget("m1")
    assert (0, 5) not in ix._graph_module and ix._graph_module[(0, 6)] == "m2"   # m1 forgotten with its graphs


def test_module_named_prefers_the_module_holding_most_of_the_instructions():
    ix = JaxIndex()
    ix.add_hlo(hlo_record("old", "jit_step", [HloKernel("fusion.1", "fusion", (DOT,)), HloKernel("fusion.2", "fusion", (ACT,))]))
    ix.add_hlo(hlo_record("new", "jit_step", [HloKernel("fusion.1", "fusion", (EXP,))]))
    ix.add_hlo(hlo_record("same", "jit_step", [HloKernel("fusion.1", "fusion", (QK,))]))
    assert ix.module_named("jit_step", {"fusion.1", "fusion.2"}).module_id == "old"   # holds both
    assert ix.module_named("jit_step", {"fusion.1", "nope"}).module_id == "old"       # one each: the larger
    ix.add_hlo(hlo_record("big", "jit_step", [HloKernel("fusion.3", "fusion", (QK,)), HloKernel("fusion.4", "fusion", (QK,))]))
    assert ix.module_named("jit_step", {"fusion.1"}).module_id == "old"               # big holds none of them
    ix._forget("old")
    assert ix.module_named("jit_step", {"fusion.1"}).module_id == "same"              # equal: the newest
    assert ix.module_named("jit_step", {"nope"}) is None and ix.module_named("jit_other", {"fusion.1"}) is None
    assert ix.modules["same"].operators([0, 0]) == (QK,)                              # distinct operators


# ---- what the agent sends always passes the daemon's schema (GPU-sized data) ----------------------

def test_stats_counters_may_be_negative_but_stay_bounded():
    base = {"t": "stats", "samples": 10, "sample_hz": 99.5, "sample_cost_us": 12.0, "dropped": {"samples": 0}}
    # the CUPTI collector's clock offset (CLOCK_MONOTONIC - CUPTI clock) is negative on real GPUs
    gpu = {"kernel": 42588, "active": 1, "clock_offset_ns": -1795995443184558837, "clock_uncertainty_ns": 199}
    (st,) = parse_message({**base, "gpu": gpu})
    assert st.gpu["clock_offset_ns"] == -1795995443184558837
    for bad in ({"x": 1 << 63}, {"x": -(1 << 63) - 1}, {"x": float("nan")}, {"x": "1"}, {"x": True},
                {f"k{i}": 1 for i in range(33)}, {"k" * 65: 1}, {"x": [1]}):
        with pytest.raises((ProtocolError, TypeError, ValueError)):
            parse_message({**base, "gpu": bad})


def test_schema_takes_long_real_names_and_refuses_beyond_the_limits():
    from stacklens.inject.agent import jaxmeta
    from stacklens.inject.channel.messages import HLO_LIMITS
    assert {k: v for k, v in jaxmeta.LIMITS.items() if k != "site_str"} == HLO_LIMITS   # the two sides agree
    long_op = "jit(train_step)/" + "transpose(jvp(remat(vmap(" * 30 + "dot_general"       # ~800 chars
    k = [["input_concatenate_reduce_select_fusion_" * 12 + ".3", "fusion", [[long_op, "/m/a.py", 3, "f" * 600]]]]
    msg = {"t": "hlo", "id": "fp", "module": "jit_train_step", "platform": "cuda", "part": 0, "parts": 1,
           "site": [], "k": k}
    (r,) = parse_message(msg)
    assert r.kernels[0].ops[0][0] == long_op
    for field, n in (("instr", 0), ("op_name", 1), ("func", 2)):
        bad = json.loads(json.dumps(msg))
        if field == "instr":
            bad["k"][0][0] = "x" * (HLO_LIMITS["instr"] + 1)
        elif field == "op_name":
            bad["k"][0][2][0][0] = "x" * (HLO_LIMITS["op_name"] + 1)
        else:
            bad["k"][0][2][0][3] = "x" * (HLO_LIMITS["func"] + 1)
        with pytest.raises(ProtocolError):
            parse_message(bad)


def test_agent_messages_of_huge_modules_fit_frames_and_the_schema():
    from stacklens.inject.agent import jaxmeta, wire
    msgs = []
    w = JaxWatcher(lambda m: msgs.append(m) or True, lambda *a: None, scan_existing=False)
    huge_op = ["jit(f)/" + "ö" * 5000, "/very/long/" + "p" * 20000 + ".py", 1 << 40, "g" * 3000]
    entries = ([["fusion.%d" % i, "fusion", []] for i in range(30000)]
               + [["n" * 5000, "fusion", [huge_op] * 80]]
               + [["loop_fusion.%d" % i, "fusion", [["jit(f)/add", "/m/a.py", i, "f"]] * 64] for i in range(300)])
    site = [("/s/" + "d" * 3000 + ".py", "main", 5)] * 100
    w._send_module("fp" * 100, "jit_" + "m" * 600, "cuda", site, entries)
    w.queue.extend(("compile", ["/jax/core/compile/backend_compile_duration", "jit(f)", 1, 2, 3, site])
                   for _ in range(3000))
    w._drain()
    assert not w.pending and w.dropped == 0
    recs = []
    for m in msgs:
        assert len(wire.encode(m)) - 4 <= wire.MAX_FRAME
        recs.extend(parse_message(json.loads(json.dumps(m, ensure_ascii=False))))
    hlo = [r for r in recs if isinstance(r, HloMapRecord)]
    assert len({r.parts for r in hlo}) == 1 and sorted(r.part for r in hlo) == list(range(hlo[0].parts))
    ix = JaxIndex()
    for r in hlo:
        ix.add_hlo(r)
    (mod,) = ix.modules.values()
    assert len(mod.entries) == len(entries)           # nothing lost, order kept
    assert mod.entries[0][0] == "fusion.0" and mod.entries[-1][0] == "loop_fusion.299"
    assert ix.resolve("loop_fusion_7") is not None
    big = mod.entries[30000]
    assert len(big[2]) == jaxmeta.MAX_OPS and big[2][0][2] == 0   # cut to the schema: ops, line out of range
    assert sum(1 for r in recs if isinstance(r, CompileRecord)) == 3000


def test_a_message_that_can_never_fit_a_frame_does_not_block_the_others():
    from stacklens.inject.agent import jaxmeta
    sent = []
    w = JaxWatcher(lambda m: sent.append(m) or True, lambda *a: None, scan_existing=False)
    w._send({"t": "hlo", "k": ["x" * (jaxmeta.FRAME_BUDGET + 10)]})
    assert w.dropped == 1 and not w.pending and not sent
    w._send({"t": "compile", "r": []})
    assert sent == [{"t": "compile", "r": []}]
    chunks, dropped = jaxmeta.chunk_by_size([[1] * 10] * 100 + [["y" * 2_000_000]], base=20, budget=100)
    assert dropped == 1 and all(len(c) * 22 + 20 <= 100 for c in chunks) and sum(map(len, chunks)) == 100


# ---- benchmarks/gpu/check_jax.py: the profiler side's mapping and the step estimate -----------------

def _check_jax():
    import importlib.util
    spec = importlib.util.spec_from_file_location(
        "check_jax", Path(__file__).resolve().parents[2] / "benchmarks" / "gpu" / "check_jax.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_check_jax_maps_command_buffer_events_by_kernel_name_and_estimates_steps():
    cj = _check_jax()
    E = cj.ProfEvent
    steps = 2
    events = []
    for s in range(steps):
        t = s * 1000
        # per-instruction stats (command buffers off) ...
        events.append(E("jit_step", "loop_maximum_fusion.1", "loop_maximum_fusion_1", 1, t, 100.0, 0))
        # ... and a CUDA graph's kernels, hlo_op = the command buffer: by kernel name, then launch order
        events.append(E("jit_step", "command_buffer_1", "input_exp_reduce_fusion", 2, t + 1, 30.0, 9))
        events.append(E("jit_step", "command_buffer_1", "loop_maximum_fusion_1", 2, t + 2, 10.0, 9))
        events.append(E("jit_step", "command_buffer_1", "sm90_xmma_gemm_f32f32_tn", 2, t + 3, 40.0, 9))
        events.append(E("jit_other", "command_buffer_2", "mystery_kernel", 3, t + 4, 5.0, 0))
    prof, ways, unknown = cj.map_profiler(events, cj._index([hlo_record()]), sanitize, steps)
    assert ways == {"hlo_op": 2, "kernel_name:name": 4, "kernel_name:order": 2, "unknown": 2}
    assert prof["dense.py:7 (dense)"] == pytest.approx((100 + 10) / 2)
    assert prof["attn.py:8 (attention)"] == pytest.approx(40.0)         # the gemm, by launch order
    assert prof["attn.py:9 (attention)"] == pytest.approx(30.0)
    assert prof["[no operator]"] == pytest.approx(5.0) and len(unknown) == 1
    # steps: stacklens saw each once-per-step kernel 1000 times (one name also outside the steps)
    import collections
    prof_counts = collections.Counter({"a": 2 * steps, "b": steps, "c": 3})
    sl_counts = collections.Counter({"a": 2000, "b": 1001, "c": 1500})
    est = cj.step_estimates(sl_counts, prof_counts, steps)
    assert est["names"] == 2 and est["median"] == pytest.approx(1000.5) and est["max_name"] == "b"
    assert cj.step_estimates(collections.Counter(), prof_counts, steps) == {"names": 0}
    assert cj.marker_line("GROW") > cj.marker_line("DENSE")


def test_library_kernels_go_one_per_custom_call_once_the_run_length_is_known():
    ix = JaxIndex()
    q, k, v = (("jit(step)/dot_general", "/m/attn.py", n, "attention") for n in (5, 6, 7))
    ix.add_hlo(hlo_record("m", "jit_step", [HloKernel("fusion.a", "fusion", (ACT,)),
                                             HloKernel("cc.1", "custom-call", (q,)), HloKernel("cc.2", "custom-call", (k,)),
                                             HloKernel("cc.3", "custom-call", (v,)), HloKernel("fusion.b", "fusion", (EXP,))]))

    def step(n_lib):
        out = [ix.resolve("fusion_a")]
        out += [ix.resolve(f"sm90_gemm_{j}") for j in range(n_lib)]
        out.append(ix.resolve("fusion_b"))
        return [r[1] for r in out[1:-1]]
    assert step(3) == [[1, 2, 3]] * 3                  # first time: the run length is unknown, even split
    assert step(3) == [[1], [2], [3]]                  # then one kernel per custom call, in order
    assert step(4) == [[1], [2], [3], [1, 2, 3]]       # a 4th kernel (split-K reduce?): even split ...
    assert step(3) == [[1, 2, 3]] * 3                  # ... and the next run is not trusted (4 != 3)
    assert step(3) == [[1], [2], [3]]


def test_a_transposed_op_without_a_line_takes_its_forward_op_s_line():
    """Rule "transposed op" (daemon/join/jaxjoin.py): XLA leaves some backward operators without
    a source line (H200 run 33: 4.5% of a step's GPU time on `transpose(jvp())/mul`)."""
    from stacklens.daemon.join.jaxjoin import forward_op_name

    assert forward_op_name("jit(step)/transpose(jvp())/mul") == "jit(step)/jvp()/mul"
    assert forward_op_name("jit(f)/transpose(jvp(pjit(g)))/transpose(x)/dot") == "jit(f)/jvp(pjit(g))/x/dot"
    ops_fwd = (("jit(step)/jvp()/mul", "m.py", 7, "loss"), ("jit(step)/jvp()/exp", "m.py", 8, "loss"),
               ("jit(step)/jvp()/exp", "m.py", 9, "loss"))
    ix = JaxIndex()
    ix.add_hlo(HloMapRecord("m1", "jit_step", "cuda", 0, 1, (), (
        HloKernel("fusion_1", "fusion", ops_fwd),
        HloKernel("fusion_2", "fusion", (("jit(step)/transpose(jvp())/mul", "", 0, ""),
                                         ("jit(step)/transpose(jvp())/exp", "", 0, ""),
                                         ("jit(step)/transpose(jvp())/sin", "", 0, ""))))))
    ops = ix.modules["m1"].operators([1])
    assert ops[0] == ("jit(step)/transpose(jvp())/mul", "m.py", 7, "loss")   # one forward mul: its line
    assert ops[1] == ("jit(step)/transpose(jvp())/exp", "", 0, "")           # two forward exps: none
    assert ops[2] == ("jit(step)/transpose(jvp())/sin", "", 0, "")           # no forward sin: none
