"""daemon/join/backward.py on fake events: what links, what is counted unlinked, what is bounded."""

from __future__ import annotations

from types import SimpleNamespace

from stacklens.cct import Frame
from stacklens.daemon.join.backward import NO_SEQUENCE, BackwardLink
from stacklens.daemon.join.splice import splice

PY = (Frame.python("model.py", "Net.forward", 42),)
OPS = ("aten::linear", "aten::addmm")


def node(addr, seq, py=PY, ops=OPS, tid=1):
    return SimpleNamespace(kind="autograd_node", api="AddmmBackward0", tid=tid, args={"node": addr, "seq": seq},
                           py_stack=py, op_path=ops, py_entries=())


def evaluate(addr, seq, tid=7, name="AddmmBackward0"):
    return SimpleNamespace(kind="autograd_eval", api=name, tid=tid, args={"node": addr, "seq": seq})


def test_linked_head_is_forward_context_then_node():
    link = BackwardLink(splice)
    link.on_node(node(0x10, 5))
    link.on_eval(evaluate(0x10, 5))
    head, linked = link.head(7, 0x10)
    assert linked
    assert head == PY + (Frame.op("aten::linear"), Frame.op("aten::addmm"), Frame.backward("AddmmBackward0"))
    assert link.stats["autograd_linked"] == 1 and link.sizes()["autograd_forward_table"] == 0


def test_reused_address_with_another_sequence_number_is_never_linked_to_the_old_context():
    link = BackwardLink(splice)
    link.on_node(node(0x10, 5))
    link.on_eval(evaluate(0x10, 6))          # a later node at the same address, created unseen
    head, linked = link.head(7, 0x10)
    assert not linked and head == (Frame.backward("AddmmBackward0"),)
    assert link.stats["autograd_unlinked"] == 1


def test_nodes_without_a_forward_op_are_counted_apart():
    link = BackwardLink(splice)
    link.on_eval(evaluate(0x20, NO_SEQUENCE, name="AccumulateGrad"))
    assert link.head(7, 0x20) == ((Frame.backward("AccumulateGrad"),), False)
    assert link.stats["autograd_no_forward"] == 1 and not link.stats["autograd_unlinked"]


def test_a_retained_graph_links_again_on_its_second_backward():
    link = BackwardLink(splice)
    link.on_node(node(0x10, 5))
    link.on_eval(evaluate(0x10, 5))
    link.on_eval(evaluate(0x10, 5))          # backward(retain_graph=True), then backward again
    assert link.stats["autograd_linked"] == 2 and link.head(7, 0x10)[1]


def test_linked_flag_holds_for_an_empty_forward_context():
    link = BackwardLink(splice)
    link.on_node(node(0x30, 1, py=(), ops=()))   # created outside Python and probed ops
    link.on_eval(evaluate(0x30, 1))
    assert link.head(7, 0x30) == ((Frame.backward("AddmmBackward0"),), True)


def test_the_forward_table_is_bounded_and_evictions_counted():
    link = BackwardLink(splice, forward_max=100)
    for i in range(1000):                     # forwards that never ran backward
        link.on_node(node(0x1000 + i, i))
    assert link.sizes()["autograd_forward_table"] == 100
    assert link.stats["autograd_forward_evicted"] == 900


def test_an_unseen_evaluation_is_counted():
    link = BackwardLink(splice)
    assert link.head(7, 0x99) is None
    assert link.stats["autograd_eval_missing"] == 1
