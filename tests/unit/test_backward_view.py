"""The two backward views (cct/backwardview.py) on snapshots the real join builds from fake events:
the forward view as the link makes it, the caller view re-rooted under `loss.backward()`."""

from __future__ import annotations

import pytest

from stacklens.cct import CCT, Frame, export
from stacklens.cct.backwardview import CALLER, caller_view, head_key, pick_backward_view, split_view
from stacklens.cct.modelview import model_view
from stacklens.daemon.join.joiner import Joiner
from stacklens.records.events import make_event

TRAIN = Frame.python("train.py", "<module>", 20)
STEP = Frame.python("train.py", "step", 11)            # out = model(x)
BACKWARD = Frame.python("train.py", "step", 12)        # loss.backward()
GEN_BACKWARD = Frame.python("train.py", "step", 14)    # a second backward() call site
ENGINE = (Frame.python("/venv/lib/python3.11/site-packages/torch/_tensor.py", "Tensor.backward", 647),
          Frame.python("/venv/lib/python3.11/site-packages/torch/autograd/__init__.py", "backward", 354),
          Frame.python("/venv/lib/python3.11/site-packages/torch/autograd/graph.py", "_engine_run_backward", 829))
FORWARD_PY = (TRAIN, STEP, Frame.python("model.py", "Net.forward", 42))
CALLER_PY = (TRAIN, BACKWARD) + ENGINE
OTHER_CALLER_PY = (TRAIN, GEN_BACKWARD) + ENGINE
NAT = (Frame.native("libtorch_cpu.so", "torch::autograd::Engine::evaluate_function"),
       Frame.native("libtorch_cpu.so", "at::native::cpublas::gemm"))
FWD_NAT = (Frame.native("libtorch_cpu.so", "at::native::addmm"),)
OPS = ("aten::linear", "aten::addmm")


def ev(kind, *, py=(), ops=(), nat=(), api="", node=0, seq=0, tid=7, bwd=0):
    args = {"node": node, "seq": seq} if kind.startswith("autograd") else {}
    return make_event(kind, api, 1, tid, 0, 0, args, ops, nat, py, bwd_node=bwd)


def training_join(callers=(CALLER_PY,), samples=30) -> Joiner:
    """One forward sample on the model line, then per caller one step's backward: the node created
    on a forward line of its own, evaluated on the calling thread, `samples` CPU samples under it."""
    j = Joiner(1)
    j.on_bpf(ev("cpu_sample", py=FORWARD_PY, ops=OPS, nat=FWD_NAT))
    for i, caller in enumerate(callers):
        fwd = FORWARD_PY[:-1] + (FORWARD_PY[-1]._replace(line=42 + i),)
        j.on_bpf(ev("autograd_node", py=fwd, ops=OPS, api="AddmmBackward0", node=0x10 + i, seq=5 + i))
        j.on_bpf(ev("autograd_eval", api="AddmmBackward0", node=0x10 + i, seq=5 + i))
        for _ in range(samples):
            j.on_bpf(ev("cpu_sample", py=caller, nat=NAT, ops=("aten::mm",), bwd=0x10 + i))
    j.on_bpf(ev("autograd_eval", api="AccumulateGrad", node=0x99, seq=(1 << 64) - 1))   # unlinked: under its caller
    for _ in range(5):
        j.on_bpf(ev("cpu_sample", py=CALLER_PY, nat=NAT, bwd=0x99))
    return j


def share_under(snap, frame: Frame) -> int:
    return sum(snap.inclusive(n, "cpu_samples") for n in range(1, snap.node_count)
               if snap.frame_of(n) == frame and frame not in snap.path(snap.parent(n)))


def test_the_forward_view_is_as_the_link_made_it():
    snap = training_join().snapshot()
    head = FORWARD_PY + (Frame.op("aten::linear"), Frame.op("aten::addmm"), Frame.backward("AddmmBackward0"))
    node = snap.find([f.label() for f in head])
    assert node is not None and snap.inclusive(node, "cpu_samples") == 30
    assert share_under(snap, BACKWARD) == 5                     # only the unlinked AccumulateGrad
    assert snap.meta["backward_callers"]["heads"] == {head_key(f.label() for f in head): 0}


def test_the_caller_view_puts_backward_work_under_loss_backward():
    snap = training_join().snapshot()
    view = caller_view(snap)
    assert share_under(view, BACKWARD) == 35                     # all backward work
    assert share_under(view, STEP) == 1                          # the forward sample alone
    path = CALLER_PY + (Frame.backward("AddmmBackward0"), Frame.op("aten::mm"))
    node = view.find([f.label() for f in path])
    assert node is not None and view.inclusive(node, "cpu_samples") == 30
    assert view.total("cpu_samples") == snap.total("cpu_samples") == 36
    # the forward context that had only backward work below it is gone, the forward op stays
    assert view.find([f.label() for f in FORWARD_PY + (Frame.op("aten::linear"), Frame.op("aten::addmm"))])
    assert not any(f.kind == "backward" for n in range(view.node_count)
                   for f in [view.frame_of(n)] if STEP in view.path(n))
    assert view.meta["backward_view"] == CALLER and view.meta["backward_view_moved"] == 1
    assert view.meta["backward_view_kept"] == 1                  # AccumulateGrad, already under its caller
    assert any("backward view: caller" in n for n in view.meta["notes"])
    leaf = view.find([f.label() for f in path + NAT[1:]])
    assert view.threads(leaf, "cpu_samples") == ((7, 30),)      # the per-thread split follows


def test_two_call_sites_give_their_common_caller_never_one_of_them():
    snap = training_join(callers=(CALLER_PY, OTHER_CALLER_PY)).snapshot()
    view = caller_view(snap)
    assert "autograd_caller_mixed" not in snap.meta["backward_link"]   # two heads, one caller each
    assert share_under(view, BACKWARD) == 35 and share_under(view, GEN_BACKWARD) == 30
    # one forward node evaluated from both sites (retain_graph): the common path, `<module>`
    j = Joiner(1)
    j.on_bpf(ev("autograd_node", py=FORWARD_PY, ops=OPS, api="AddmmBackward0", node=0x10, seq=5))
    for caller in (CALLER_PY, OTHER_CALLER_PY):
        j.on_bpf(ev("autograd_eval", api="AddmmBackward0", node=0x10, seq=5))
        for _ in range(10):
            j.on_bpf(ev("cpu_sample", py=caller, nat=NAT, bwd=0x10))
    snap = j.snapshot()
    assert snap.meta["backward_link"]["autograd_caller_mixed"] == 1
    view = caller_view(snap)
    node = view.find([TRAIN.label(), "backward:AddmmBackward0"])
    assert node is not None and view.inclusive(node, "cpu_samples") == 20
    assert share_under(view, BACKWARD) == share_under(view, GEN_BACKWARD) == 0


def test_a_thread_without_python_puts_its_work_at_the_root():
    j = Joiner(1)
    j.on_bpf(ev("autograd_node", py=FORWARD_PY, ops=OPS, api="AddmmBackward0", node=0x10, seq=5))
    j.on_bpf(ev("autograd_eval", api="AddmmBackward0", node=0x10, seq=5, tid=9))   # a CUDA worker
    j.on_bpf(ev("cpu_sample", nat=NAT, bwd=0x10, tid=9))
    view = caller_view(j.snapshot())
    assert view.find(["backward:AddmmBackward0"]) is not None
    # root, backward, its native frame (gemm): the forward context, with nothing left below it, went
    assert [view.frame_of(n) for n in range(1, view.node_count)] == [Frame.backward("AddmmBackward0"), NAT[1]]


def test_a_snapshot_without_a_table_is_kept_and_says_so():
    tree = CCT()
    tree.add(FORWARD_PY + (Frame.backward("AddmmBackward0"),), "cpu_samples", 4)
    snap = tree.snapshot()
    view = caller_view(snap)
    assert list(view.iter_paths()) == list(snap.iter_paths())
    assert view.meta["backward_view_moved"] == 0 and view.meta["backward_view_kept"] == 1


def test_the_views_travel_through_a_saved_profile_and_compose_with_the_model_view(tmp_path):
    snap = training_join().snapshot()
    path = tmp_path / "p.json.gz"
    export.save(snap, path)
    loaded = export.load(path)
    assert list(caller_view(loaded).iter_paths()) == list(caller_view(snap).iter_paths())
    assert caller_view(caller_view(snap)).meta["notes"].count(caller_view(snap).meta["notes"][-1]) == 1
    both = model_view(caller_view(snap))    # Tensor.backward and the engine entry collapse into the line
    node = both.find([TRAIN.label(), BACKWARD.label(), "backward:AddmmBackward0"])
    assert node is not None and both.inclusive(node, "cpu_samples") == 30
    assert pick_backward_view(snap, "forward") is snap


@pytest.mark.parametrize("text, want", [
    ("auto", ("auto", "forward")), ("caller", ("auto", "caller")), ("model+caller", ("model", "caller")), ("model,caller", ("model", "caller")),
    ("full", ("full", "forward")), ("caller+full", ("full", "caller")), ("forward", ("auto", "forward")),
])
def test_split_view(text, want):
    assert split_view(text) == want


def test_split_view_refuses_unknown_parts():
    with pytest.raises(ValueError, match="unknown view 'callers'"):
        split_view("model+callers")


@pytest.mark.parametrize("fmt", ["text", "json", "folded"])
def test_report_view_caller_and_the_default_unchanged(tmp_path, fmt):
    from stacklens.cli import main as cli

    saved = tmp_path / "p.json.gz"
    export.save(training_join().snapshot(), saved)
    out = {v: tmp_path / f"{v}.out" for v in ("default", "forward", "caller", "full+caller")}
    assert cli.main(["report", "--input", str(saved), "--format", fmt, "-o", str(out["default"])]) == 0
    for v in ("forward", "caller", "full+caller"):
        assert cli.main(["report", "--input", str(saved), "--format", fmt, "--view", v, "-o", str(out[v])]) == 0
    text = {v: p.read_text() for v, p in out.items()}
    assert text["forward"] == text["default"]
    assert text["caller"] != text["default"]
    if fmt == "folded":   # the backward work under the loss.backward() line, in both shapes
        rows = [ln for ln in text["full+caller"].splitlines() if "backward:AddmmBackward0" in ln]
        assert rows and all(ln.startswith("<module> (train.py:20);step (train.py:12);") for ln in rows), rows
    else:                 # the output says which view it is
        assert "backward view: caller" in text["caller"] and "backward view: caller" not in text["default"]
        assert "backward_view" in text["caller"] and "backward_view" not in text["default"]
