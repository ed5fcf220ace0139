"""torch.compile (Inductor): wrapper lines mapped to the model's lines (daemon/join/compiled.py), on
the agent's messages recorded from a real CPU compile of tests/targets/compiled_mlp.py (its
`--dump` mode), and the agent's collection (inject/agent/inductor.py) on a fake code cache."""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import pytest

from stacklens.cct import Frame
from stacklens.daemon.join.compiled import InductorIndex, build_map, parse_trace
from stacklens.daemon.join.joiner import Joiner
from stacklens.inject.agent import inductor as agent_inductor
from stacklens.inject.channel.inductor import parse_inductor
from stacklens.records.agent import PySample
from stacklens.inject.channel.validate import ProtocolError

ROOT = Path(__file__).resolve().parents[2]
RECORDED = ROOT / "tests" / "data" / "inductor" / "compiled_mlp_cpu.json"
MODEL = "/src/tests/targets/compiled_mlp.py"
LINES = {line.rsplit("MODEL_LINE ", 1)[1]: i for i, line in
         enumerate((ROOT / "tests" / "targets" / "compiled_mlp.py").read_text().splitlines(), 1) if "# MODEL_LINE" in line}


@pytest.fixture(scope="module")
def index() -> InductorIndex:
    idx = InductorIndex()
    for msg in json.loads(RECORDED.read_text()):
        idx.add(parse_inductor(msg))
    return idx


def _modules(idx):
    fwd = next(m for m in idx.modules.values() if not m.backward)
    bwd = next(m for m in idx.modules.values() if m.backward)
    return fwd, bwd


def _kernel_lines(m):
    """kernel -> (model line of its stack trace, other lines) for every kernel line of a module."""
    out = {}
    for ln in sorted(m.kernels):
        stack, kernel, others = m.at(ln)
        assert stack[-1].file == MODEL and stack[-1].name == "forward"
        out.setdefault(kernel, []).append((stack[-1].line, others))
    return out


def test_forward_kernels_land_on_their_model_lines(index):
    fwd, _ = _modules(index)
    k = _kernel_lines(fwd)
    assert [ln for ln, _ in k["extern_kernels.addmm"]] == [LINES["up"], LINES["down"]]
    # fused relu * sigmoid(relu): the line map's node is the multiply (its region, though
    # Inductor writes the C++ call after the next node's region began)
    assert k["cpp_fused_mul_relu_sigmoid_0"] == [(LINES["gate"], ())]
    assert k["cpp_fused_add_mean_pow_1"] == [(LINES["down"], ())]


def test_backward_module_is_marked_and_names_fused_lines(index):
    _, bwd = _modules(index)
    k = _kernel_lines(bwd)
    assert {ln for v in k.values() for ln, _ in v} <= set(LINES.values())
    assert len(k["extern_kernels.mm"]) == 3      # the weight gradients and one input gradient
    # the `Source Nodes` comment of an extern kernel names post-grad nodes of another line
    labels = [index.tail((Frame.python(bwd.path, "Runner.call", ln),))[-1].name for ln in sorted(bwd.kernels)]
    assert all(lb.startswith("[compiled backward] ") for lb in labels)
    assert any("(fused: compiled_mlp.py:" in lb for lb in labels), labels


def test_rewrite_replaces_dynamo_and_wrapper_frames_by_the_stack_trace(index):
    fwd, _ = _modules(index)
    ln = next(ln for ln, (k, _, _) in fwd.kernels.items() if k.startswith("cpp_fused_mul"))
    torch_py = "/venv/lib/python3.11/site-packages/torch/"
    path = (Frame.python("/src/train.py", "main", 40),
            Frame.python(MODEL, "MLP.forward", 24),                       # dynamo's frame of forward
            Frame.python(torch_py + "_dynamo/eval_frame.py", "_fn", 1000),
            Frame.python(fwd.path, "Runner.call", ln),
            Frame.native("c2x.so", "kernel"))
    out = index.rewrite(path)
    assert out == (path[0], Frame.python(MODEL, "forward", LINES["gate"]),
                   Frame.op("[compiled] cpp_fused_mul_relu_sigmoid_0 (fused: last node's line)"), path[-1])
    # no frame of the stack trace's function above: only the torch frames above the wrapper go
    out = index.rewrite((path[0],) + path[2:])
    assert out[0] == path[0] and out[1] == Frame.python(MODEL, "forward", LINES["gate"])
    # not a wrapper's `call`, or a line before the first region: unchanged
    assert index.rewrite(path[:3]) == path[:3]
    assert index.rewrite((Frame.python(fwd.path, "get_args", ln),)) == (Frame.python(fwd.path, "get_args", ln),)
    assert index.rewrite((Frame.python(fwd.path, "call", 1),)) == (Frame.python(fwd.path, "call", 1),)


def test_joiner_charges_agent_samples_in_the_wrapper_to_model_lines(index):
    fwd, _ = _modules(index)
    j = Joiner(1, agent=True)
    for msg in json.loads(RECORDED.read_text()):
        j.on_agent(parse_inductor(msg))
    ln = next(ln for ln, (k, _, _) in fwd.kernels.items() if k == "extern_kernels.addmm")
    j.on_agent(PySample(7, 0, (("/src/train.py", "main", 40), (fwd.path, "Runner.call", ln))))
    snap = j.snapshot()
    paths = [tuple(f.label() for f in p) for p, m in snap.iter_paths() if m.get("py_samples")]
    assert paths == [("py:/src/train.py:main:40", f"py:{MODEL}:forward:{LINES['up']}",
                      "op:[compiled] extern_kernels.addmm")]
    assert snap.meta["inductor"]["modules"] == 2
    assert any(n.startswith("inductor:") for n in snap.meta["notes"])


TRITON = '''# AOT ID: ['0_forward']
# kernel path: /tmp/torchinductor_u/ab/cab.py
# Topologically Sorted Source Nodes: [linear, relu, mul, sigmoid], Original ATen: [aten.relu, aten.mul]
# Source node to ATen node mapping:
#   linear => addmm
#   relu => relu
#   mul => mul, sigmoid
# Graph fragment:
#   %relu : Tensor "f32[8][1]cuda:0"[num_users=2] = call_function[target=torch.ops.aten.relu.default](args = (%addmm,), kwargs = {})
triton_poi_fused_mul_relu_sigmoid_0 = async_compile.triton('triton_poi_fused_mul_relu_sigmoid_0', \'\'\'
        buf1 = empty_strided_cuda((8, ), (1, ), torch.float32)
        # Topologically Sorted Source Nodes: [relu, mul], Original ATen: [aten.relu, aten.mul]
        stream0 = get_raw_stream(0)
        triton_poi_fused_mul_relu_sigmoid_0.run(buf0, buf1, 8, stream=stream0)
        return (buf1, )
'''


def test_a_triton_kernel_names_every_source_line_of_its_comment():
    lines = [(i, t) for i, t in enumerate(TRITON.splitlines(), 1) if t.strip() and (i >= 11 or t.startswith(("#", "triton")))]
    trace = '  File "/m.py", line 9, in forward\n    h = h * torch.sigmoid(h)\n'
    nodes = [("addmm", "/m.py", 8, "forward"), ("relu", "/m.py", 8, "forward"), ("mul", "/m.py", 9, "forward"),
             ("sigmoid", "/m.py", 9, "forward")]
    m = build_map("/w.py", lines, [(11, 0)], [trace], nodes)
    idx = InductorIndex()
    idx.modules["/w.py"] = m
    (py, op), = [idx.tail((Frame.python("/w.py", "call", 14),))]
    assert py == Frame.python("/m.py", "forward", 9)
    assert op.name == "[compiled] triton_poi_fused_mul_relu_sigmoid_0 (fused: m.py:8)"
    assert idx.tail((Frame.python("/w.py", "call", 11),))[-1].name == "[compiled] wrapper"


def test_parse_trace_reads_traceback_frames_outermost_first():
    t = ('  File "/a/model.py", line 20, in forward\n    x = self.block(x)\n'
         '  File "/a/block.py", line 7, in forward\n    return self.mlp(x)\n        ^^^^\n')
    assert parse_trace(t) == (Frame.python("/a/model.py", "forward", 20), Frame.python("/a/block.py", "forward", 7))
    assert parse_trace("no frames") == ()


@pytest.mark.parametrize("rows", [[["X", 1]], [["M", 0, 0]], [["S", 1]], [["T", 5]], ["S"], [["N", "a", "f", -1, "g"]]])
def test_bad_inductor_rows_are_refused(rows):
    with pytest.raises(ProtocolError):
        parse_inductor({"t": "inductor", "path": "/w.py", "part": 0, "parts": 1, "r": rows})


def test_parts_join_and_bounds():
    idx = InductorIndex()
    base = {"t": "inductor", "path": "/w.py", "parts": 2}
    t = '  File "/m.py", line 3, in f\n    y = g(x)\n'
    assert not idx.add(parse_inductor({**base, "part": 1, "r": [["S", 5, "        cpp_fused_g_0(buf0)"]]}))
    assert idx.add(parse_inductor({**base, "part": 0, "r": [["T", t], ["M", 4, 0],
                                                           ["S", 1, "cpp_fused_g_0 = async_compile.cpp_pybinding(['float*'], r'''"]]}))
    assert idx.modules["/w.py"].at(5)[1] == "cpp_fused_g_0"
    assert not idx.add(parse_inductor({**base, "part": 0, "r": []}))   # a module is taken once


# ---- the agent's side --------------------------------------------------------------------------

GRAPH = '''class GraphModule(torch.nn.Module):
    def forward(self, primals_1: "f32[4]cpu"):
        # File: /m.py:8 in forward, code: h = torch.relu(s.a(x))
        permute: "f32[4]" = torch.ops.aten.permute.default(primals_1, [1, 0])
        relu: "f32[4]" = torch.ops.aten.relu.default(permute)

        # File: /m.py:9 in forward, code: h = h * torch.sigmoid(h)
        mul: "f32[4]" = torch.ops.aten.mul.Tensor(relu, relu)
        return (mul,)
'''


def test_agent_reads_post_grad_node_lines():
    assert agent_inductor.post_grad_nodes(GRAPH) == [("permute", "/m.py", 8, "forward"), ("relu", "/m.py", 8, "forward"),
                                                     ("mul", "/m.py", 9, "forward")]


def test_agent_watcher_sends_each_module_once_and_notes_unreadable_ones(tmp_path, monkeypatch):
    wrapper = tmp_path / "cabc.py"
    wrapper.write_text("# AOT ID: ['0_forward']\nimport torch\ncpp_fused_a_0 = async_compile.cpp_pybinding([], r'''\n"
                       "#include <x.h>\n''')\ndef call(args):\n    buf0 = empty()\n    cpp_fused_a_0(buf0)\n")
    cache = types.SimpleNamespace(linemaps={str(wrapper): [(7,), ('  File "/m.py", line 3, in f\n',)],
                                            str(tmp_path / "gone.py"): [(1,), ("",)]})
    monkeypatch.setitem(sys.modules, agent_inductor.CODECACHE, types.SimpleNamespace(PyCodeCache=cache))
    sent, notes = [], []
    w = agent_inductor.InductorWatcher(lambda m: sent.append(m) or True, lambda lv, t: notes.append(t))
    w.poll()
    w.poll()
    assert [m["path"] for m in sent] == [str(wrapper)]
    rows = sent[0]["r"]
    assert ["M", 7, 0] in rows and ["S", 8, "    cpp_fused_a_0(buf0)"] in rows
    assert ["S", 3, "cpp_fused_a_0 = async_compile.cpp_pybinding([], r'''"] in rows
    assert len(notes) == 1 and "gone.py" in notes[0] and w.dropped == 1
    m = build_map(str(wrapper), *[[tuple(r[1:]) for r in rows if r[0] == k] for k in ("S", "M")],
                  [r[1] for r in rows if r[0] == "T"], [])
    assert m.at(8)[1] == "cpp_fused_a_0" and m.at(8)[0] == (Frame.python("/m.py", "f", 3),)
