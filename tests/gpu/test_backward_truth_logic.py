"""tests/gpu/backward_truth.py's two sides on synthetic input (no GPU): ours from a tree, the
truth from torch.profiler-like records linked by (sequence number, forward thread)."""

from stacklens.cct import CCT, Frame
from tests.gpu.backward_truth import compare_modules, ours_by_module, truth_by_module

PY = (Frame.python("/x/transformers/m.py", "Conv1D.forward", 5),)


def test_ours_splits_forward_and_backward_by_the_backward_frame():
    t = CCT(metrics=("gpu_time_ns",))
    t.add_many(PY + (Frame.op("aten::addmm"), Frame.kernel("k")), {"gpu_time_ns": 2000})
    t.add_many(PY + (Frame.op("aten::addmm"), Frame.backward("AddmmBackward0"), Frame.kernel("k2")),
               {"gpu_time_ns": 4000})
    assert ours_by_module(t.snapshot(), 1) == {("Conv1D", "fwd"): 2.0, ("Conv1D", "bwd"): 4.0}


def test_truth_links_backward_kernels_to_the_forward_module_by_sequence_number():
    ev = [
        {"name": "module:Conv1D", "parent": -1, "seq": -1, "fwd": 0, "thread": 1, "stack": [], "kernels": [], "start": 0},
        {"name": "aten::addmm", "parent": 0, "seq": 7, "fwd": 0, "thread": 1, "stack": [], "kernels": [["k", 2.0]], "start": 1},
        {"name": "autograd::engine::evaluate_function: AddmmBackward0", "parent": -1, "seq": 7, "fwd": 1,
         "thread": 2, "stack": [], "kernels": [], "start": 10},
        {"name": "aten::mm", "parent": 2, "seq": -1, "fwd": 0, "thread": 2, "stack": [], "kernels": [["k2", 4.0]], "start": 11},
    ]
    truth = truth_by_module(ev, 1)
    assert truth == {("Conv1D", "fwd"): 2.0, ("Conv1D", "bwd"): 4.0}
    ours = {("Conv1D", "fwd"): 2.0, ("Conv1D", "bwd"): 4.06}
    c = compare_modules(ours, truth)
    assert c["pass"] and c["worst_class_error"] == 0.01
