"""The model view (cct/modelview.py): plumbing collapsed, module calls named, totals exact."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from stacklens.cct import CCT, Frame
from stacklens.cct.modelview import PLUMBING, class_of_forward, has_model, model_view, module_text, pick_view

SITE = "/venv/lib/python3.12/site-packages"
MOD = f"{SITE}/torch/nn/modules/module.py"
GPT2 = f"{SITE}/transformers/models/gpt2/modeling_gpt2.py"

USER = (Frame.python("/srv/train.py", "<module>", 40), Frame.python("/srv/train.py", "step", 25))
WRAPPED = Frame.python(MOD, "Module._wrapped_call_impl", 1778)
CALL = Frame.python(MOD, "Module._call_impl", 1789)
CALL_PATH = (WRAPPED, CALL)
DECORATOR = Frame.python(f"{SITE}/transformers/utils/generic.py", "can_return_tuple.<locals>.wrapper", 1036)
MODEL_FWD = Frame.python(GPT2, "GPT2Model.forward", 683)
BLOCK_FWD = Frame.python(GPT2, "GPT2Block.forward", 390)
ATTN_FWD = Frame.python(GPT2, "GPT2Attention.forward", 320)
ATTN_FWD_2 = Frame.python(GPT2, "GPT2Attention.forward", 331)
ADDMM = Frame.op("aten::addmm")


def snap_of(*paths_values):
    tree = CCT(("cpu_samples", "gpu_time_ns"))
    for path, values in paths_values:
        tree.add_many(tuple(path), values)
    return tree.snapshot(meta={"pid": 7})


def labels(snap, node):
    return [f.label() for f in snap.path(node)]


def test_wrappers_collapse_and_forwards_are_named_by_class() -> None:
    raw = snap_of(
        ((*USER, *CALL_PATH, DECORATOR, MODEL_FWD, *CALL_PATH, BLOCK_FWD, *CALL_PATH, ATTN_FWD, ADDMM),
         {"cpu_samples": 5, "gpu_time_ns": 100}),
        ((*USER, *CALL_PATH, DECORATOR, MODEL_FWD, *CALL_PATH, BLOCK_FWD, *CALL_PATH, ATTN_FWD_2, ADDMM),
         {"cpu_samples": 2, "gpu_time_ns": 30}),
    )
    view = model_view(raw)
    node = view.find(["py:/srv/train.py:<module>:40", "py:/srv/train.py:step:25", "module:GPT2Model:",
                      "module:GPT2Block:", "module:GPT2Attention:", "op:aten::addmm"])
    assert node is not None
    # the two lines of one forward merge into the module's node, by summing
    assert view.inclusive(node, "cpu_samples") == 7 and view.inclusive(node, "gpu_time_ns") == 130
    assert not any("_call_impl" in f.label() or "wrapper" in f.label() for f in view.path(node))
    assert view.meta["view"] == "model" and view.meta["view_collapsed_nodes"] == 7 and view.meta["pid"] == 7
    assert raw.find([f.label() for f in (*USER, WRAPPED)]) is not None   # the full view is untouched


def test_agent_module_frames_name_the_call_with_its_path() -> None:
    block = Frame.module("transformer.h.3", "GPT2Block")
    attn = Frame.module("transformer.h.3.attn", "GPT2SdpaAttention")
    raw = snap_of(((*USER, *CALL_PATH, block, BLOCK_FWD, *CALL_PATH, attn, ATTN_FWD, ADDMM), {"cpu_samples": 3}))
    view = model_view(raw)
    node = view.find([*(f.label() for f in USER), "module:GPT2Block:transformer.h.3",
                      "module:GPT2SdpaAttention:transformer.h.3.attn", "op:aten::addmm"])
    assert node is not None and view.inclusive(node, "cpu_samples") == 3
    assert module_text(attn) == "transformer.h.3.attn · GPT2SdpaAttention"
    assert module_text(Frame.module("", "GPT2LMHeadModel")) == "GPT2LMHeadModel"


def test_a_forward_not_called_as_a_module_stays_a_python_frame() -> None:
    raw = snap_of(((*USER, ATTN_FWD, ADDMM), {"cpu_samples": 1}))
    view = model_view(raw)
    assert view.find([*(f.label() for f in USER), ATTN_FWD.label(), "op:aten::addmm"]) is not None
    assert not has_model(raw)


def test_collapsed_frames_charge_their_own_values_to_the_caller() -> None:
    raw = snap_of(((*USER, *CALL_PATH), {"cpu_samples": 4}), ((*USER, *CALL_PATH, ATTN_FWD), {"cpu_samples": 1}))
    view = model_view(raw)
    step = view.find([f.label() for f in USER])
    assert view.exclusive(step, "cpu_samples") == 4
    assert view.inclusive(step, "cpu_samples") == 5


def test_every_rule_collapses_a_frame_it_names() -> None:
    examples = {
        "module call wrapper": (MOD, "Module._call_impl.<locals>.inner"),
        "submodule and parameter lookup": (MOD, "Module.__getattr__"),
        "transformers' checkpointing layer call": (
            f"{SITE}/transformers/modeling_layers.py",
            "GradientCheckpointingLayer.__init_subclass__.<locals>.forward_with_checkpointing"),
        "transformers decorator (can_return_tuple, deprecate_kwarg …)": (
            f"{SITE}/transformers/utils/deprecation.py", "deprecate_kwarg.<locals>.wrapper.<locals>.wrapped_func"),
        "functools wrapper (wraps, singledispatch, partialmethod)": ("/usr/lib/python3.12/functools.py", "wrapper"),
        "contextmanager / ContextDecorator": ("/usr/lib/python3.12/contextlib.py", "_GeneratorContextManager.__enter__"),
        "no_grad / inference_mode decorator": (f"{SITE}/torch/utils/_contextlib.py",
                                               "context_decorator.<locals>.decorate_context"),
        "dynamo entry / disable wrapper": (f"{SITE}/torch/_dynamo/eval_frame.py",
                                           "DisableContext.__call__.<locals>._fn"),
        "dynamo wrapper": (f"{SITE}/torch/_dynamo/external_utils.py", "wrap_inline.<locals>.inner"),
        "torch._disable_dynamo wrapper": (f"{SITE}/torch/_compile.py", "_disable_dynamo.<locals>.inner"),
        "operator overload dispatch": (f"{SITE}/torch/_ops.py", "OpOverloadPacket.__call__"),
        "record_function scope": (f"{SITE}/torch/autograd/profiler.py", "record_function.__enter__"),
        "Tensor method wrapper": (f"{SITE}/torch/_tensor.py", "Tensor.backward"),
        "autograd entry": (f"{SITE}/torch/autograd/__init__.py", "backward"),
        "autograd engine entry": (f"{SITE}/torch/autograd/graph.py", "_engine_run_backward"),
        "optimizer step hooks and no-grad wrapper": (f"{SITE}/torch/optim/optimizer.py",
                                                     "Optimizer.profile_hook_step.<locals>.wrapper"),
    }
    assert set(examples) == {r.why for r in PLUMBING}
    for why, (file, qualname) in examples.items():
        raw = snap_of(((*USER, Frame.python(file, qualname, 1), ADDMM), {"cpu_samples": 1}))
        assert model_view(raw).find([*(f.label() for f in USER), "op:aten::addmm"]) is not None, why
    # real work in the same modules is kept
    for file, qualname in ((f"{SITE}/torch/optim/adam.py", "Adam.step"), (MOD, "Module.zero_grad"),
                           (f"{SITE}/transformers/utils/generic.py", "ModelOutput.__post_init__")):
        raw = snap_of(((*USER, Frame.python(file, qualname, 1)), {"cpu_samples": 1}))
        assert model_view(raw).node_count == raw.node_count, qualname


PY = st.sampled_from([*USER, WRAPPED, CALL, DECORATOR, MODEL_FWD, BLOCK_FWD, ATTN_FWD, ATTN_FWD_2, ADDMM,
                      Frame.module("h.0", "GPT2Block"), Frame.other("truncated")])


@given(st.lists(st.tuples(st.lists(PY, max_size=8), st.integers(0, 1000), st.integers(0, 10**6)), max_size=30))
def test_totals_are_preserved(rows) -> None:
    raw = snap_of(*((path, {"cpu_samples": c, "gpu_time_ns": g}) for path, c, g in rows))
    view = model_view(raw)
    for m in raw.metrics:
        assert view.total(m) == raw.total(m)
    assert all(view.parent(n) < n for n in range(1, view.node_count))
    assert model_view(view) is view


def test_pick_view_and_names() -> None:
    raw = snap_of(((*USER, *CALL_PATH, ATTN_FWD), {"cpu_samples": 1}))
    assert pick_view(raw, "full") is raw
    assert pick_view(raw, "model").meta["view"] == "model"
    assert has_model(raw)
    assert class_of_forward("make.<locals>.Head.forward") == "Head"
