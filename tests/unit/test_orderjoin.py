"""Kernel records joined to BPF launches by launch order, without CUPTI API records."""

from __future__ import annotations

from stacklens.daemon.join.joiner import Joiner
from stacklens.records.agent import JoinKind
from stacklens.daemon.join.orderjoin import REORDER_NS, SETTLE_NS
from stacklens.records.agent import AgentStats, KernelRecord as _Kernel
from tests.fakes.sources import FakeEvent, py

STEP_A = (py("main", 10), py("step_a", 20))
STEP_B = (py("main", 10), py("step_b", 30))
SMALL = dict(grid_x=1, grid_y=1, grid_z=1, block_x=128, block_y=1, block_z=1)
BIG = dict(grid_x=264, grid_y=1, grid_z=1, block_x=256, block_y=1, block_z=1)


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def launch(t, stack, dims, op="aten::add", kind="launch", api="cuLaunchKernel", tid=1):
    ev = FakeEvent(kind=kind, tid=tid, ktime_ns=t, api=api, op_path=(op,), py_stack=stack)
    object.__setattr__(ev, "args", dict(dims) if dims else {})
    return ev


def kernel(corr, start, dur, dims, name="k", graph_id=0):
    return _Kernel(name=name, start_ns=start, end_ns=start + dur, device=0, stream=7, correlation_id=corr,
                   grid=(dims["grid_x"], dims["grid_y"], dims["grid_z"]),
                   block=(dims["block_x"], dims["block_y"], dims["block_z"]), graph_id=graph_id)


def make():
    clock = Clock()
    j = Joiner(1, agent=True, join=JoinKind.ORDER, clock=clock)
    j.on_agent(AgentStats(0, 0.0, 0.0, {}, {"active": 1, "api_records": 0, "enabled_at_ns": 1_000}))
    return j, clock


def settle(j, clock):
    clock.t += SETTLE_NS / 1e9 + 0.1
    j.expire(int(clock.t * 1e9))


def gpu(snap, stack, op="aten::add", api="cuLaunchKernel", name="k", marker=()):
    n = snap.find([f.label() for f in stack] + [f"op:{op}", f"api:{api}", *marker, f"kernel:{name}"])
    return 0 if n is None else snap.inclusive(n, "gpu_time_ns")


def test_kernels_claim_launches_in_order_even_when_records_arrive_out_of_order():
    j, clock = make()
    j.on_bpf(launch(500, STEP_A, SMALL))           # before the collector was enabled: no record
    j.on_bpf(launch(2_000, STEP_A, SMALL))
    j.on_bpf(launch(3_000, STEP_B, BIG, op="aten::mm"))
    j.on_bpf(launch(4_000, STEP_A, SMALL))
    # buffers from two streams come back out of order; ids step by one per launch
    j.on_agent(kernel(3, 9_000, 300, SMALL))
    j.on_agent(kernel(1, 5_000, 100, SMALL))
    j.on_agent(kernel(2, 6_000, 2_000, BIG))
    assert j.snapshot().total("gpu_time_ns") == 0      # still settling
    settle(j, clock)
    snap = j.snapshot()
    assert gpu(snap, STEP_A) == 400
    assert gpu(snap, STEP_B, op="aten::mm") == 2_000
    st = j.stats.as_dict()
    assert st["kernels_joined"] == 3 and st["order_before_enable"] == 1 and st["order_skipped_launches"] == 0


def test_a_lost_record_of_another_shape_is_skipped_and_the_order_recovers():
    j, clock = make()
    j.on_bpf(launch(2_000, STEP_A, SMALL))
    j.on_bpf(launch(3_000, STEP_B, BIG, op="aten::mm"))   # its record is lost
    later = 3_000 + REORDER_NS + 1_000                      # too long before the next claim to be a race
    j.on_bpf(launch(later, STEP_A, SMALL))
    j.on_agent(kernel(1, 5_000, 100, SMALL))
    j.on_agent(kernel(3, later + 5_000, 300, SMALL))
    settle(j, clock)
    snap = j.snapshot()
    assert gpu(snap, STEP_A) == 400 and gpu(snap, STEP_B, op="aten::mm") == 0
    st = j.stats.as_dict()
    assert st["order_skipped_launches"] == 1 and st["kernels_joined"] == 2 and st["kernels_unmatched"] == 0


def test_a_launch_after_the_kernel_started_cannot_be_its_launch():
    j, clock = make()
    j.on_bpf(launch(100_000, STEP_A, SMALL))   # entered after the kernel below started
    j.on_agent(kernel(1, 5_000, 100, SMALL))
    settle(j, clock)
    snap = j.snapshot()
    n = snap.find(["[launch not seen]", "kernel:k"])
    assert n is not None and snap.inclusive(n, "gpu_time_ns") == 100
    assert j.stats.kernels_unmatched == 1 and j.stats.kernels_joined == 0


def test_graph_launch_groups_every_kernel_of_one_correlation_id():
    j, clock = make()
    j.on_bpf(launch(2_000, STEP_A, None, op="aten::replay", kind="graph", api="cuGraphLaunch"))
    for i in range(3):
        j.on_agent(kernel(1, 5_000 + i * 1_000, 200, BIG if i else SMALL, name=f"g{i}", graph_id=9))
    j.on_bpf(launch(3_000, STEP_B, SMALL))
    j.on_agent(kernel(2, 9_000, 50, SMALL))
    settle(j, clock)
    snap = j.snapshot()
    for i in range(3):
        assert gpu(snap, STEP_A, op="aten::replay", api="cuGraphLaunch", name=f"g{i}",
                   marker=["[graph: captured before attach]"]) == 200
    assert gpu(snap, STEP_B) == 50


def test_detach_joins_what_is_still_settling():
    j, clock = make()
    j.on_bpf(launch(2_000, STEP_A, SMALL))
    j.on_agent(kernel(1, 5_000, 100, SMALL))
    j.finish()
    assert gpu(j.snapshot(), STEP_A) == 100


def test_two_threads_whose_correlation_ids_cross_their_entry_order_both_join():
    # thread 1 enters cuLaunchKernel first, but thread 2's launch takes the lower correlation id
    j, clock = make()
    j.on_bpf(launch(2_000, STEP_A, SMALL, tid=1))
    j.on_bpf(launch(2_500, STEP_B, BIG, op="aten::mm", tid=2))
    j.on_agent(kernel(1, 6_000, 2_000, BIG))
    j.on_agent(kernel(2, 9_000, 100, SMALL))
    settle(j, clock)
    snap = j.snapshot()
    assert gpu(snap, STEP_B, op="aten::mm") == 2_000 and gpu(snap, STEP_A) == 100
    st = j.stats.as_dict()
    assert st["kernels_joined"] == 2 and st["order_skipped_launches"] == 0 and st["order_reordered"] == 1
