"""CUPTI copy and memset records joined to the BPF call that issued them (daemon/join/joiner.py, copies
section): by order (default, no API records) and exactly through API records; bytes counted once;
what cannot be joined lands under `[copy call not seen]` or keeps its call's own bytes, counted."""

from __future__ import annotations

from stacklens.cct import Frame
from stacklens.cct.export import decode_profile, encode_profile
from stacklens.daemon.join.apijoin import COPY_WAIT_MAX_NS
from stacklens.daemon.join.joiner import Joiner
from stacklens.records.agent import JoinKind
from stacklens.daemon.join.orderjoin import SETTLE_NS
from stacklens.records.agent import AgentStats, ApiRecord, MemcpyRecord
from tests.fakes.sources import FakeEvent, py
from tests.unit.test_orderjoin import SMALL, Clock, kernel, launch

STEP_A = (py("main", 10), py("step_a", 20))
STEP_B = (py("main", 10), py("step_b", 30))


def call(t, api, nbytes, stack=STEP_B, direction="default", tid=1, dur=0):
    ev = FakeEvent(kind="memcpy", tid=tid, ktime_ns=t, api=api, op_path=("aten::copy_",), py_stack=stack,
                   bytes=nbytes, duration_ns=dur)
    object.__setattr__(ev, "direction", direction)
    object.__setattr__(ev, "args", {})
    return ev


def memset_call(t, api, n, stack=STEP_A, tid=1):
    return call(t, api, n, stack=stack, direction="memset", tid=tid)


def copy(corr, kind, nbytes, start, dur, memory="", graph_id=0):
    return MemcpyRecord(kind, nbytes, start, start + dur, 0, 7, corr, memory, graph_id)


def base(stack, api):
    return [f.label() for f in stack] + ["op:aten::copy_", f"api:{api}"]


def make(api_records=False):
    clock = Clock()
    j = Joiner(1, agent=True, join=JoinKind.API_RECORDS if api_records else JoinKind.ORDER, clock=clock)
    j.on_agent(AgentStats(0, 0.0, 0.0, {}, {"active": 1, "api_records": int(api_records), "enabled_at_ns": 1_000}))
    return j, clock


def settle(j, clock):
    clock.t += SETTLE_NS / 1e9 + 1
    j.expire(int(clock.t * 1e9))


def test_order_join_charges_gpu_time_bytes_and_counts_under_the_calling_path():
    j, clock = make()
    j.on_bpf(launch(10_000, STEP_A, SMALL))
    j.on_bpf(call(20_000, "cuMemcpyAsync", 4096, dur=3_000))
    j.on_bpf(memset_call(30_000, "cuMemsetD32Async", 64))           # 64 elements of 4 bytes
    j.on_bpf(call(40_000, "cuMemcpyDtoH_v2", 8, direction="DtoH"))
    j.on_agent(kernel(1, 11_000, 500, SMALL))
    j.on_agent(copy(2, "HtoD", 4096, 25_000, 2_000, "Pageable -> Device"))
    j.on_agent(copy(3, "memset", 256, 31_000, 100, "Device"))
    j.on_agent(copy(4, "DtoH", 8, 41_000, 700, "Device -> Pageable"))
    settle(j, clock)
    snap = j.snapshot()
    h2d = snap.find(base(STEP_B, "cuMemcpyAsync") + ["memcpy:HtoD (Pageable -> Device)"])
    assert snap.exclusive(h2d, "gpu_time_ns") == 2_000 and snap.exclusive(h2d, "memcpy_count") == 1
    assert snap.exclusive(h2d, "copy_bytes") == 4096
    api = snap.find(base(STEP_B, "cuMemcpyAsync"))
    assert snap.exclusive(api, "copy_bytes") == 0 and snap.exclusive(api, "api_cpu_ns") == 3_000
    ms = snap.find(base(STEP_A, "cuMemsetD32Async") + ["memset:Device"])
    assert snap.exclusive(ms, "memset_bytes") == 256 and snap.exclusive(ms, "memset_count") == 1
    assert snap.exclusive(ms, "gpu_time_ns") == 100
    d2h = snap.find(base(STEP_B, "cuMemcpyDtoH_v2") + ["memcpy:DtoH (Device -> Pageable)"])
    assert snap.exclusive(d2h, "gpu_time_ns") == 700
    assert snap.total("copy_bytes") == 4096 + 8 and snap.total("memset_bytes") == 256     # never twice
    assert snap.total("kernel_count") == 1 and snap.total("memcpy_count") == 2
    assert snap.total("gpu_time_ns") == 500 + 2_000 + 100 + 700
    st = j.stats.as_dict()
    assert st["copies_joined"] == 3 and st.get("copies_unjoined", 0) == 0


def test_order_join_matches_by_bytes_and_kind_so_a_lost_record_costs_one_call():
    j, clock = make()
    j.on_bpf(call(20_000, "cuMemcpyAsync", 4096))                  # its record is lost
    j.on_bpf(call(21_000, "cuMemcpyAsync", 128))
    j.on_bpf(memset_call(22_000, "cuMemsetD8Async", 100))
    j.on_agent(copy(8, "memset", 100, 22_500, 10, "Device"))      # ids step over the lost one
    j.on_agent(copy(7, "DtoH", 128, 21_500, 50, "Device -> Pinned"))
    settle(j, clock)
    j.finish()
    snap = j.snapshot()
    assert snap.exclusive(snap.find(base(STEP_B, "cuMemcpyAsync") + ["memcpy:DtoH (Device -> Pinned)"]),
                          "gpu_time_ns") == 50
    assert snap.exclusive(snap.find(base(STEP_A, "cuMemsetD8Async") + ["memset:Device"]), "memset_bytes") == 100
    # the call no record claimed keeps the bytes it asked for, on its own API node
    assert snap.exclusive(snap.find(base(STEP_B, "cuMemcpyAsync")), "copy_bytes") == 4096
    assert snap.total("copy_bytes") == 4096 + 128
    assert j.stats.as_dict()["copy_calls_unmatched"] == 1


def test_a_record_no_call_claims_is_shown_under_copy_call_not_seen():
    j, clock = make()
    j.on_agent(copy(5, "HtoD", 999, 50_000, 300, "Pinned -> Device"))   # e.g. cuMemcpy2DAsync: not probed
    settle(j, clock)
    snap = j.snapshot()
    node = snap.find(["[copy call not seen]", "memcpy:HtoD (Pinned -> Device)"])
    assert snap.exclusive(node, "gpu_time_ns") == 300 and snap.exclusive(node, "copy_bytes") == 999
    assert j.stats.as_dict()["copies_unjoined"] == 1


def test_calls_before_the_collector_was_enabled_keep_their_own_bytes():
    j, clock = make()
    j.on_bpf(call(500, "cuMemcpyAsync", 64))                        # enabled_at_ns is 1_000
    j.on_bpf(call(2_000, "cuMemcpyAsync", 64))
    j.on_agent(copy(3, "HtoD", 64, 2_500, 40, "Pageable -> Device"))
    settle(j, clock)
    snap = j.snapshot()
    assert snap.exclusive(snap.find(base(STEP_B, "cuMemcpyAsync")), "copy_bytes") == 64
    assert snap.exclusive(snap.find(base(STEP_B, "cuMemcpyAsync") + ["memcpy:HtoD (Pageable -> Device)"]),
                          "copy_bytes") == 64
    assert snap.total("copy_bytes") == 128
    assert j.stats.as_dict()["copy_order_before_enable"] == 1


def test_graph_memset_nodes_join_with_the_graph_launch():
    j, clock = make()
    j.on_bpf(launch(10_000, STEP_A, None, kind="graph", api="cuGraphLaunch"))
    j.on_agent(kernel(9, 11_000, 400, SMALL, name="k_in_graph", graph_id=3))
    j.on_agent(copy(9, "memset", 512, 10_500, 20, "Device", graph_id=3))
    j.on_bpf(launch(20_000, STEP_A, None, kind="graph", api="cuGraphLaunch"))
    j.on_agent(copy(12, "memset", 512, 20_500, 30, "Device", graph_id=3))   # a graph of one memset
    settle(j, clock)
    snap = j.snapshot()
    g = [f.label() for f in STEP_A] + ["op:aten::add", "api:cuGraphLaunch"]
    assert snap.exclusive(snap.find(g + ["memset:Device"]), "gpu_time_ns") == 50
    assert snap.exclusive(snap.find(g + ["memset:Device"]), "memset_count") == 2
    # a graph captured before the attach: its kernel named under the marker (daemon/join/graphs.py)
    assert snap.exclusive(snap.find(g + ["[graph: captured before attach]", "kernel:k_in_graph"]),
                          "gpu_time_ns") == 400
    assert j.stats.as_dict().get("copies_unjoined", 0) == 0


def test_exact_join_through_copy_api_records_with_the_record_first():
    j, clock = make(api_records=True)
    j.on_bpf(launch(10_000, STEP_A, SMALL, tid=7))
    j.on_bpf(call(20_000, "cuMemcpyAsync", 4096, tid=7))
    j.on_bpf(memset_call(30_000, "cuMemsetD32Async", 16, tid=7))
    j.on_agent(copy(31, "HtoD", 4096, 22_000, 900, "Pinned -> Device"))    # before its API record
    j.on_agent(ApiRecord("runtime", "cudaLaunchKernel_v7000", 7, 9_900, 12_000, 30, 211))
    j.on_agent(ApiRecord("runtime", "cudaMemcpyAsync_v3020", 7, 19_900, 21_000, 31, 41))
    j.on_agent(ApiRecord("runtime", "cudaMemsetAsync_v3020", 7, 29_900, 31_000, 32, 51))
    j.on_agent(copy(32, "memset", 64, 31_500, 10, "Device"))
    j.on_agent(kernel(30, 12_500, 200, SMALL))
    snap = j.snapshot()
    assert snap.exclusive(snap.find(base(STEP_B, "cuMemcpyAsync") + ["memcpy:HtoD (Pinned -> Device)"]),
                          "gpu_time_ns") == 900
    assert snap.exclusive(snap.find(base(STEP_A, "cuMemsetD32Async") + ["memset:Device"]), "memset_bytes") == 64
    assert snap.total("kernel_count") == 1 and snap.total("copy_bytes") == 4096
    assert j.stats.launches_unmatched == 0 and j.stats.as_dict().get("copy_calls_unmatched", 0) == 0


def test_exact_join_a_record_without_api_record_is_shown_after_waiting():
    j, clock = make(api_records=True)
    j.on_agent(copy(40, "DtoD", 32, 5_000, 10, "Device -> Device"))
    j.expire(0)
    assert j.snapshot().total("memcpy_count") == 0                 # still waiting for its API record
    clock.t += COPY_WAIT_MAX_NS / 1e9 + 1
    j.expire(int(clock.t * 1e9))
    snap = j.snapshot()
    assert snap.exclusive(snap.find(["[copy call not seen]", "memcpy:DtoD (Device -> Device)"]), "memcpy_count") == 1


def test_exact_join_graph_copy_waits_for_the_graph_launch_api_record():
    j, clock = make(api_records=True)
    j.on_bpf(launch(1_000, STEP_A, None, kind="graph", api="cuGraphLaunch", tid=7))
    j.on_agent(copy(50, "memset", 8, 1_500, 5, "Device", graph_id=2))
    j.on_agent(ApiRecord("runtime", "cudaGraphLaunch_v10000", 7, 990, 1_200, 50, 311))
    snap = j.snapshot()
    g = [f.label() for f in STEP_A] + ["op:aten::add", "api:cuGraphLaunch", "memset:Device"]
    assert snap.exclusive(snap.find(g), "memset_count") == 1


def test_without_an_agent_calls_carry_their_bytes_at_once_and_gpu_metrics_are_unavailable():
    j = Joiner(1, agent=False)
    j.on_bpf(call(1_000, "cuMemcpyHtoDAsync_v2", 4096, direction="HtoD"))
    j.on_bpf(memset_call(2_000, "cuMemsetD32Async", 10))
    j.on_bpf(memset_call(3_000, "cuMemsetD16Async", 10))
    j.on_bpf(memset_call(4_000, "cuMemsetD8Async", 10))
    snap = j.snapshot()
    assert snap.total("copy_bytes") == 4096
    assert snap.total("memset_bytes") == 40 + 20 + 10
    assert {"gpu_time_ns", "memcpy_count", "memset_count"} <= set(snap.unavailable)


def test_copy_frames_survive_every_export_format():
    j, clock = make()
    j.on_bpf(call(20_000, "cuMemcpyAsync", 16))
    j.on_agent(copy(2, "DtoH", 16, 25_000, 200, "Device -> Pinned"))
    j.on_bpf(memset_call(30_000, "cuMemsetD8Async", 4))
    j.on_agent(copy(3, "memset", 4, 31_000, 20, "Device"))
    settle(j, clock)
    snap = j.snapshot()
    back = decode_profile(encode_profile(snap))
    kinds = {p[-1].kind for p, _ in back.iter_paths() if p}
    assert {"memcpy", "memset"} <= kinds
    for label in ("memcpy:DtoH (Device -> Pinned)", "memset:Device"):
        assert Frame.from_label(label).label() == label
    assert back.total("gpu_time_ns") == 220 and back.total("memset_count") == 1
