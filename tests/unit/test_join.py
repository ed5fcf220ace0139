"""The join: BPF launches + CUPTI records → GPU time on the exact launching path."""

from __future__ import annotations

from stacklens.cct import Frame
from stacklens.daemon.join.joiner import Joiner
from stacklens.daemon.join.splice import trim_native
from stacklens.records.agent import ApiRecord as _Api, KernelRecord as _Kernel, Note, PySample
from tests.fakes.sources import FakeEvent, py


def ApiRecord(tid, name, start, end, corr, domain="driver"):
    return _Api(domain=domain, name=name, tid=tid, start_ns=start, end_ns=end, correlation_id=corr)


def KernelRecord(name, start, end, correlation_id):
    return _Kernel(name=name, start_ns=start, end_ns=end, device=0, stream=7, correlation_id=correlation_id)

STEP_A = (py("main", 10), py("step_a", 20))
STEP_B = (py("main", 10), py("step_b", 30))


def launch(tid, t, stack, op="aten::add", kernel=""):
    return FakeEvent(kind="launch", tid=tid, ktime_ns=t, api="cuLaunchKernel", op_path=(op,), py_stack=stack, kernel_name=kernel)


def test_without_agent_gpu_time_is_unavailable_not_zero():
    j = Joiner(1, agent=False)
    j.on_bpf(launch(1, 100, STEP_A))
    snap = j.snapshot()
    assert {"gpu_time_ns", "kernel_count"} <= snap.unavailable
    n = snap.find(["py:train.py:main:10", "py:train.py:step_a:20", "op:aten::add", "api:cuLaunchKernel"])
    assert n is not None and snap.inclusive(n, "launch_count") == 1


def test_kernels_land_on_the_launching_path_in_order_per_thread():
    j = Joiner(1, agent=True)
    # thread 1 launches from step_a twice, thread 2 from step_b once, interleaved in time
    j.on_bpf(launch(1, 1_000_000, STEP_A))
    j.on_bpf(launch(2, 1_500_000, STEP_B, op="aten::mm"))
    j.on_bpf(launch(1, 2_000_000, STEP_A))
    # CUPTI: API records (thread, interval, correlation); kernel records arrive before some APIs
    j.on_agent(KernelRecord("add_kernel", 10_000, 10_400, correlation_id=7))
    j.on_agent(ApiRecord(1, "cuLaunchKernel", 900_000, 1_100_000, 7))
    j.on_agent(ApiRecord(2, "cuLaunchKernel", 1_400_000, 1_600_000, 8))
    j.on_agent(ApiRecord(1, "cuLaunchKernel", 1_900_000, 2_100_000, 9))
    j.on_agent(KernelRecord("gemm", 11_000, 13_000, correlation_id=8))
    j.on_agent(KernelRecord("add_kernel", 14_000, 14_600, correlation_id=9))
    snap = j.snapshot()
    a = snap.find([f.label() for f in STEP_A] + ["op:aten::add", "api:cuLaunchKernel", "kernel:add_kernel"])
    b = snap.find([f.label() for f in STEP_B] + ["op:aten::mm", "api:cuLaunchKernel", "kernel:gemm"])
    assert snap.inclusive(a, "gpu_time_ns") == 400 + 600
    assert snap.inclusive(a, "kernel_count") == 2
    assert snap.inclusive(b, "gpu_time_ns") == 2_000
    assert snap.total("gpu_time_ns") == 3_000
    assert j.stats.kernels_joined == 3 and j.stats.launches_unmatched == 0


def test_launches_cupti_never_saw_are_counted_not_charged():
    j = Joiner(1, agent=True)
    j.on_bpf(launch(1, 100_000, STEP_A))  # before CUPTI was active
    j.on_bpf(launch(1, 2_000_000, STEP_B))
    j.on_agent(ApiRecord(1, "cuLaunchKernel", 1_900_000, 2_100_000, 5))
    j.on_agent(KernelRecord("k", 0, 50, 5))
    snap = j.snapshot()
    assert j.stats.launches_unmatched == 1
    assert snap.total("gpu_time_ns") == 50
    b = snap.find([f.label() for f in STEP_B] + ["op:aten::add", "api:cuLaunchKernel", "kernel:k"])
    assert snap.inclusive(b, "gpu_time_ns") == 50


def test_sync_copy_alloc_and_cpu_samples():
    j = Joiner(1, agent=True)
    j.on_bpf(FakeEvent(kind="sync", api="cuStreamSynchronize", py_stack=STEP_A, op_path=("aten::item",), duration_ns=5_000))
    j.on_bpf(FakeEvent(kind="memcpy", api="cuMemcpyHtoD_v2", py_stack=STEP_B, bytes=4096, duration_ns=100))
    j.on_bpf(FakeEvent(kind="alloc", api="cuMemAlloc_v2", py_stack=STEP_B, bytes=1 << 20))
    j.on_bpf(FakeEvent(kind="cpu_sample", py_stack=STEP_A, op_path=("aten::linear", "aten::addmm"),
                       native_stack=(Frame.native("libtorch_cpu.so", "at::native::addmm"),)))
    j.on_agent(PySample(tid=1, t_ns=0, frames=(("train.py", "main", 10), ("train.py", "step_a", 20))))
    j.finish()   # with an agent a copy call waits for its CUPTI record; none came: its own bytes count
    snap = j.snapshot()
    assert snap.total("sync_wait_ns") == 5_000
    assert snap.total("copy_bytes") == 4096
    assert snap.total("alloc_bytes") == 1 << 20
    leaf = snap.find([f.label() for f in STEP_A] + ["op:aten::linear", "op:aten::addmm", "native:libtorch_cpu.so:at::native::addmm"])
    assert snap.exclusive(leaf, "cpu_samples") == 1
    assert snap.total("py_samples") == 1


def test_agent_samples_name_module_calls():
    j = Joiner(1, agent=True)
    j.on_agent(PySample(tid=1, t_ns=0, frames=(("train.py", "main", 10),
                                               ("gpt2.py", "GPT2Attention.forward", 7, "h.3.attn", "GPT2Attention"))))
    snap = j.snapshot()
    leaf = snap.find(["py:train.py:main:10", "module:GPT2Attention:h.3.attn", "py:gpt2.py:GPT2Attention.forward:7"])
    assert leaf is not None and snap.exclusive(leaf, "py_samples") == 1


def test_trim_native_drops_interpreter_frames_and_marks_cuts():
    # the Symbolizer names a frame by the mapped file's basename: a statically linked interpreter
    # (Debian/Ubuntu system Pythons) is "python3.11", a shared one "libpython3.11.so.1.0"
    for interp in ("python3.11", "python3", "libpython3.12.so.1.0", "libpython3.13t.so.1.0",
                   "/usr/bin/python3.11"):   # a full path too: by its basename
        frames = (
            Frame.native(interp, "_start"),
            Frame.native(interp, "_PyEval_EvalFrameDefault"),
            Frame.native("libtorch_python.so", "THPVariable_add"),
            Frame.native("libtorch_cpu.so", "at::_ops::add::call"),
        )
        assert trim_native(frames) == frames[2:], interp
    # not the interpreter: an extension module under a python3.x directory, a library named python
    for other in ("/usr/lib/python3.12/lib-dynload/_json.cpython-312-x86_64-linux-gnu.so",
                  "libtorch_python.so", "mypython3", "libpython2.7.so.1.0"):
        frames = (Frame.native(other, "f"), Frame.native("libc.so.6", "g"))
        assert trim_native(frames) == frames, other
    deep = tuple(Frame.native("libx.so", f"f{i}") for i in range(40))
    out = trim_native(deep)
    assert out[0] == Frame.other("[truncated]") or out[-1] == Frame.other("[truncated]")
    assert len(out) == 17


def test_runtime_record_wrapping_the_driver_launch_maps_to_the_same_path():
    j = Joiner(1, agent=True)
    j.on_bpf(launch(1, 1_000_000, STEP_A))
    j.on_agent(ApiRecord(1, "cuLaunchKernel", 950_000, 1_050_000, 11))  # driver exits first
    j.on_agent(ApiRecord(1, "cudaLaunchKernel", 900_000, 1_100_000, 12, domain="runtime"))
    j.on_agent(KernelRecord("k", 0, 70, 12))  # correlated with the runtime call
    snap = j.snapshot()
    n = snap.find([f.label() for f in STEP_A] + ["op:aten::add", "api:cuLaunchKernel", "kernel:k"])
    assert snap.inclusive(n, "gpu_time_ns") == 70 and j.stats.launches_unmatched == 0


def test_graph_launch_charges_every_kernel_of_the_graph():
    j = Joiner(1, agent=True)
    j.on_bpf(FakeEvent(kind="graph", tid=1, ktime_ns=500_000, api="cuGraphLaunch", py_stack=STEP_B))
    j.on_agent(ApiRecord(1, "cuGraphLaunch", 400_000, 600_000, 3))
    for i in range(5):
        j.on_agent(KernelRecord(f"fusion_{i}", 1000 * i, 1000 * i + 10, 3))
    snap = j.snapshot()
    assert snap.total("kernel_count") == 5 and snap.total("gpu_time_ns") == 50
    base = [f.label() for f in STEP_B] + ["api:cuGraphLaunch"]
    assert snap.inclusive(snap.find(base), "kernel_count") == 5


def test_agent_notes_reach_the_snapshot_meta():
    j = Joiner(1, agent=True)
    j.on_agent(Note(level="warning", message="torch.profiler is active: CUPTI collector yields"))
    assert "agent warning: torch.profiler is active" in j.snapshot().meta["notes"][0]


def test_bpf_entry_slightly_before_cupti_start_still_claims():
    """The uprobe fires at the first instruction; CUPTI stamps the record later (and clocks differ)."""
    j = Joiner(1, agent=True)
    for i in range(50):  # a launch-bound loop: a launch every 7 us
        j.on_bpf(launch(1, 10_000 + 7_000 * i, STEP_A if i % 2 else STEP_B))
    for i in range(50):
        t = 10_000 + 7_000 * i
        j.on_agent(ApiRecord(1, "cuLaunchKernel", t + 400, t + 3_000, 100 + i))  # 0.4 us after entry
        j.on_agent(KernelRecord(f"k{i % 2}", 0, 10 + i % 2, 100 + i))
    snap = j.snapshot()
    a = snap.find([f.label() for f in STEP_A] + ["op:aten::add", "api:cuLaunchKernel", "kernel:k1"])
    b = snap.find([f.label() for f in STEP_B] + ["op:aten::add", "api:cuLaunchKernel", "kernel:k0"])
    assert snap.inclusive(a, "kernel_count") == 25 and snap.inclusive(b, "kernel_count") == 25
    assert snap.total("gpu_time_ns") == 25 * 11 + 25 * 10
    assert j.stats.launches_unmatched == 0


def test_out_of_order_bpf_delivery_is_sorted_per_thread():
    j = Joiner(1, agent=True)
    j.on_bpf(launch(1, 2_000_000, STEP_B))
    j.on_bpf(launch(1, 1_000_000, STEP_A))  # arrived late
    j.on_agent(ApiRecord(1, "cuLaunchKernel", 900_000, 1_100_000, 1))
    j.on_agent(ApiRecord(1, "cuLaunchKernel", 1_900_000, 2_100_000, 2))
    j.on_agent(KernelRecord("ka", 0, 5, 1))
    j.on_agent(KernelRecord("kb", 0, 7, 2))
    snap = j.snapshot()
    assert snap.find([f.label() for f in STEP_A] + ["op:aten::add", "api:cuLaunchKernel", "kernel:ka"]) is not None
    assert snap.find([f.label() for f in STEP_B] + ["op:aten::add", "api:cuLaunchKernel", "kernel:kb"]) is not None


def test_agent_without_a_gpu_collector_leaves_gpu_time_unavailable():
    from stacklens.records.agent import AgentStats

    j = Joiner(1, agent=True)
    j.on_agent(AgentStats(samples=10, sample_hz=100.0, sample_cost_us=5.0, gpu={}))
    assert {"gpu_time_ns", "kernel_count"} <= j.snapshot().unavailable
    assert "py_samples" not in j.snapshot().unavailable
    j.on_agent(AgentStats(samples=10, sample_hz=100.0, sample_cost_us=5.0, gpu={"active": 1}))
    assert not ({"gpu_time_ns", "kernel_count"} & j.snapshot().unavailable)


def test_cupti_names_an_unresolved_handle_for_later_launches():
    """A driver launch of a CUfunction whose name BPF never saw shows as `unresolved:0x…`; once a
    CUPTI kernel record names it, its GPU time goes to the named node and so do later launches; the
    launches before the name was learnt are moved there in the snapshot (daemon/join/rename.py), so
    launch counts and GPU time meet on one node and no `unresolved:` node is left."""
    j = Joiner(1, agent=True)
    j.on_bpf(launch(1, 1_000_000, STEP_A, kernel="unresolved:0xabc"))
    j.on_agent(ApiRecord(1, "cuLaunchKernel", 900_000, 1_100_000, 7))
    mangled = "_ZN2at6native3fooEv"
    j.on_agent(KernelRecord(mangled, 10_000, 10_400, correlation_id=7))
    j.on_bpf(launch(1, 2_000_000, STEP_A, kernel="unresolved:0xabc"))
    j.on_agent(ApiRecord(1, "cuLaunchKernel", 1_900_000, 2_100_000, 8))
    j.on_agent(KernelRecord(mangled, 20_000, 20_500, correlation_id=8))
    snap = j.snapshot()
    base = [f.label() for f in STEP_A] + ["op:aten::add", "api:cuLaunchKernel"]
    named = snap.find(base + ["kernel:at::native::foo()"])   # demangled, like torch.profiler shows it
    assert named is not None
    assert snap.inclusive(named, "gpu_time_ns") == 400 + 500
    assert snap.inclusive(named, "kernel_count") == 2
    assert snap.inclusive(named, "launch_count") == 2          # the first launch too, counted before the name
    assert snap.find(base + ["kernel:unresolved:0xabc"]) is None
    assert not any(snap.frame_of(i).name.startswith("unresolved:") for i in range(snap.node_count))
    assert snap.total("launch_count") == 2
    assert snap.meta["unresolved_kernels"] == {"renamed": {"unresolved:0xabc": "at::native::foo()"},
                                               "unnamed_launches": 0}
    assert not any("carry no kernel name" in n for n in snap.meta.get("notes", ()))
    # the live tree is left as it was: the next snapshot renames again
    assert j.snapshot() == snap


def test_agent_stats_reach_the_session_stats_under_known_names_only():
    """The agent's sampler rate/cost and drop counters show in stats (benchmarks, /metrics'
    drop sum); drop kinds are the agent's known names — keys a target invents are ignored."""
    from stacklens.records.agent import AgentStats

    j = Joiner(1, agent=True)
    j.on_agent(AgentStats(samples=250, sample_hz=99.6, sample_cost_us=41.7,
                          dropped={"samples": 3, "gpu_buffers": 2, "evil\nname": 7}, gpu={}))
    st = j.stats.as_dict()
    assert (st["agent_samples"], st["agent_sample_hz"], st["agent_sample_cost_us"]) == (250, 100, 42)
    assert st["agent_dropped_samples"] == 3 and st["agent_dropped_gpu_buffers"] == 2
    assert not any("evil" in k for k in st)
    # values are the target's too: a negative or huge one must not break uint64 sums (Health)
    j.on_agent(AgentStats(samples=-5, sample_hz=1e300, sample_cost_us=float("nan"),
                          dropped={"samples": -7, "gpu": 2 ** 80}, gpu={}))
    st = j.stats.as_dict()
    assert st["agent_samples"] == 0 and st["agent_dropped_samples"] == 0
    assert 0 <= st["agent_sample_hz"] <= 1 << 53 and st["agent_dropped_gpu"] <= 1 << 53
    assert st["agent_sample_cost_us"] == 0


def test_the_agent_samples_at_20_hz_only_where_bpf_reads_python_stacks():
    """The agent's sampler takes the GIL: 20 Hz when BPF samples on-CPU Python stacks; when it does
    not (unsupported CPython, CPU sampling off) the agent is the only Python view and the session
    asks for no rate (None): the agent samples at its own default."""
    import os

    from stacklens.bpf.report import AttachReport
    from stacklens.daemon import session as session_mod
    from stacklens.daemon.session import AGENT_SAMPLE_HZ, ProcessSession

    def attached(python_stacks, hz, agent_config=None):
        report = AttachReport(os.getpid(), (), 0, hz, 0.0, python_stacks=python_stacks)
        probes = type("P", (), {"attach": lambda self: report, "poll": lambda self, *a, **k: [],
                                "detach": lambda self: None, "stats": lambda self: {}})()
        asked = []

        def agent_factory(pid, **kw):
            asked.append(kw)
            return type("A", (), {"poll": lambda self, *a: [], "stop": lambda self: True,
                                  "close": lambda self: None})()

        s = ProcessSession(os.getpid(), agent=True, cpu_hz=hz, probe_factory=lambda pid, **kw: probes,
                           agent_factory=agent_factory, agent_config=agent_config)
        s.start()
        s.stop()
        return s, asked[0]

    s, kw = attached(True, 99)
    assert s._default_sample_hz() == AGENT_SAMPLE_HZ == 20 and kw["sample_hz"] == 20
    for python_stacks, hz in ((False, 99), (True, 0)):
        s, kw = attached(python_stacks, hz)
        assert s._default_sample_hz() is None and kw["sample_hz"] is None
    _, kw = attached(False, 99, {"sample_hz": 5})   # an explicit rate (benchmarks' variants) wins
    assert kw["sample_hz"] == 5 and kw["config"] == {"sample_hz": 5}
    assert not hasattr(session_mod, "AGENT_SAMPLE_HZ_ALONE")
    assert "AGENT_DEFAULTS" not in vars(session_mod)   # no eager import of the agent package


def test_an_interpreter_replaced_on_disk_is_still_the_interpreter():
    """A Python upgraded while the job runs is mapped as "... (deleted)"; its frames are still
    the interpreter's."""
    from stacklens.daemon.join.splice import _is_interp

    for f in ("libpython3.12.so.1.0 (deleted)", "python3.12 (deleted)", "/usr/bin/python3.11 (deleted)"):
        assert _is_interp(Frame.native(f, "_PyEval_EvalFrameDefault")), f
    assert not _is_interp(Frame.native("libtorch_python.so (deleted)", "THPVariable_add"))
