"""The CUPTI collector against a fake of cupti-python's surface (activity API only)."""

import enum
import types
from pathlib import Path

import pytest

from stacklens.inject.agent import gpu as gpu_mod
from stacklens.inject.agent.gpu.cupti import CuptiCollector


class ActivityKind(enum.IntEnum):
    KERNEL = 3
    MEMCPY = 1
    MEMSET = 2
    DRIVER = 4
    RUNTIME = 5
    CONCURRENT_KERNEL = 10
    SYNCHRONIZATION = 38
    OVERHEAD = 12


class CallbackDomain(enum.IntEnum):
    DRIVER_API = 1
    RUNTIME_API = 2


class ActivityMemcpyKind(enum.IntEnum):
    UNKNOWN = 0
    HTOD = 1
    DTOH = 2


class ActivitySynchronizationType(enum.IntEnum):
    EVENT_SYNCHRONIZE = 1
    STREAM_WAIT_EVENT = 2
    STREAM_SYNCHRONIZE = 3
    CONTEXT_SYNCHRONIZE = 4


class ActivityThreadIdType(enum.IntEnum):
    DEFAULT = 0
    SYSTEM = 1


class FakeCupti:
    ActivityKind = ActivityKind
    ActivityThreadIdType = ActivityThreadIdType
    CallbackDomain = CallbackDomain
    ActivityMemcpyKind = ActivityMemcpyKind
    ActivitySynchronizationType = ActivitySynchronizationType

    def __init__(self, clock_offset=1_000_000):
        self.enabled = set()
        self.callbacks = None
        self.pending = []
        self.flushes = []
        self.clock_offset = clock_offset
        self.now = 5_000_000_000
        self.thread_id_type = ActivityThreadIdType.DEFAULT
        self.api_on = {}            # (domain, cbid) -> enabled
        self.flush_period = 0

    def get_thread_id_type(self):
        return self.thread_id_type

    def set_thread_id_type(self, t):
        self.thread_id_type = t

    def activity_enable_driver_api(self, cbid, enable):
        self.api_on[("driver", cbid)] = bool(enable)

    def activity_enable_runtime_api(self, cbid, enable):
        self.api_on[("runtime", cbid)] = bool(enable)

    def activity_flush_period(self, ms):
        self.flush_period = ms

    def get_timestamp(self):
        import time
        return time.monotonic_ns() - self.clock_offset

    def activity_register_callbacks(self, req, done):
        self.callbacks = (req, done)

    def activity_enable(self, kind):
        self.enabled.add(kind)

    def activity_disable(self, kind):
        self.enabled.discard(kind)

    def activity_flush_all(self, flag):
        self.flushes.append(flag)
        size, _ = self.callbacks[0]()
        assert size > 0
        if self.pending:
            recs, self.pending = self.pending, []
            self.callbacks[1](recs)

    def get_callback_name(self, domain, cbid):
        return {(CallbackDomain.RUNTIME_API, 211): "cudaLaunchKernel_v7000"}.get((domain, cbid), f"fn{cbid}")

    def subscribe(self, *a):
        raise AssertionError("the teardown subscribes through ctypes (cupti_teardown._Finalizer), never here")

    def finalize(self):
        raise AssertionError("the teardown finalizes through ctypes (cupti_teardown._Finalizer), never here")


def rec(kind, **kw):
    return types.SimpleNamespace(kind=kind, **kw)


def fake_gpu(profiler=None):
    g = types.SimpleNamespace(**{k: getattr(gpu_mod, k) for k in ("ClockCalibration",)})
    g.state = {"profiler": profiler, "maps_reads": 0}

    def user_profiler_active(maps=True):
        g.state["maps_reads"] += bool(maps)
        return g.state["profiler"]
    g.user_profiler_active = user_profiler_active
    g.mapped_libraries = lambda: {"/opt/nvidia/cu13/lib/libcupti.so.13"}
    return g


def make(profiler=None):
    lib, notes, rows = FakeCupti(), [], []
    c = CuptiCollector(lambda lvl, msg: notes.append((lvl, msg)), lib=lib, gpu=fake_gpu(profiler),
                       thread_ids={77: 4242})
    return c, lib, notes, rows


def test_activity_only_launch_apis_system_tids_and_clock_conversion():
    c, lib, notes, rows = make()
    assert c.start(lambda k, r: rows.append((k, r)))
    K = ActivityKind
    assert lib.enabled == {K.CONCURRENT_KERNEL, K.MEMCPY, K.MEMSET, K.RUNTIME, K.DRIVER}
    # API records only for launch calls: the rest of PyTorch's API chatter stays off
    assert {k for k, on in lib.api_on.items() if on} == {("runtime", 211)}
    assert lib.api_on[("driver", 5)] is False and lib.thread_id_type == ActivityThreadIdType.SYSTEM
    assert lib.flush_period == 1000
    off = c.clock.offset_ns
    assert abs(off - lib.clock_offset) < 1_000_000   # calibrated within 1 ms of the truth
    lib.pending = [
        rec(K.CONCURRENT_KERNEL, name="gemm", start=100, end=400, device_id=0, stream_id=7,
            correlation_id=11, grid_x=1, grid_y=2, grid_z=3, block_x=4, block_y=5, block_z=6, graph_id=0),
        rec(K.CONCURRENT_KERNEL, name="running", start=100, end=0, device_id=0, stream_id=7,
            correlation_id=12, grid_x=1, grid_y=1, grid_z=1, block_x=1, block_y=1, block_z=1, graph_id=0),
        rec(K.RUNTIME, cbid=211, thread_id=77, start=50, end=90, correlation_id=11),
        rec(K.MEMCPY, copy_kind=1, bytes=4096, start=10, end=20, device_id=0, stream_id=7, correlation_id=13),
        rec(K.MEMSET, bytes=64, start=30, end=31, device_id=0, stream_id=7, correlation_id=14),
        rec(K.SYNCHRONIZATION, type=3, start=500, end=900, stream_id=7, correlation_id=15),
        rec(K.OVERHEAD),
    ]
    c._next_check_ns = 0
    c.poll()
    assert lib.flushes == [0]                       # never a forced flush
    # the periodic profiler check runs on the target's GIL: it never reads /proc/self/maps
    assert c._gpu.state["maps_reads"] == 1          # once, at start
    kinds = [k for k, _ in rows]
    assert kinds == ["kernel", "api", "memcpy", "memcpy", "sync"]  # (a sync record, if CUPTI sends one, still parses)
    k = rows[0][1]
    assert k[0] == "gemm" and k[1] == 100 + off and k[2] == 400 + off and k[6:12] == [1, 2, 3, 4, 5, 6]
    assert rows[1][1][:3] == ["runtime", "cudaLaunchKernel_v7000", 77]   # SYSTEM ids are kernel tids
    assert rows[2][1][0] == "HtoD" and rows[3][1][0] == "memset" and rows[4][1][0] == "stream"
    assert c.stats()["unknown"] == 2
    c.stop()
    assert lib.enabled == set() and lib.flushes[-1] == 1     # forced only at detach
    assert lib.thread_id_type == ActivityThreadIdType.DEFAULT and lib.flush_period == 0  # left as found


def test_pthread_ids_are_mapped_when_system_ids_are_unavailable():
    class OldCupti(FakeCupti):
        set_thread_id_type = None  # an older cupti-python without the call

    lib, rows = OldCupti(), []
    c = CuptiCollector(lambda lvl, msg: None, lib=lib, gpu=fake_gpu(), thread_ids={77: 4242})
    c.start(lambda k, r: rows.append((k, r)))
    lib.pending = [rec(ActivityKind.RUNTIME, cbid=211, thread_id=77, start=50, end=90, correlation_id=11),
                   rec(ActivityKind.RUNTIME, cbid=211, thread_id=99, start=50, end=90, correlation_id=12)]
    c.poll()
    assert [r[1][2] for r in rows] == [4242, 0]   # unknown (C++) threads: 0, looked up once
    assert 99 in c._unknown_tids


def test_rows_pass_the_daemon_validation():
    from stacklens.inject.channel.messages import parse_message
    c, lib, notes, rows = make()
    c.start(lambda k, r: rows.append((k, r)))
    K = ActivityKind
    lib.pending = [rec(K.CONCURRENT_KERNEL, name="k", start=1, end=2, device_id=0, stream_id=7,
                       correlation_id=1, grid_x=1, grid_y=1, grid_z=1, block_x=1, block_y=1, block_z=1,
                       graph_id=3),
                   rec(K.DRIVER, cbid=5, thread_id=1, start=1, end=2, correlation_id=2)]
    c.poll()
    for kind, row in rows:
        assert parse_message({"t": kind, "r": [row]})


def test_yields_to_a_user_profiler_and_resumes():
    c, lib, notes, rows = make(profiler="torch.profiler")
    assert c.start(lambda k, r: rows.append((k, r)))
    assert lib.enabled == set() and c.yielded_to == "torch.profiler"
    assert any("yields" in m and "torch.profiler" in m for _, m in notes)
    c._gpu.state["profiler"] = None
    c._next_check_ns = 0   # the check runs at most once a second
    c.poll()
    assert lib.enabled and c.active
    c._gpu.state["profiler"] = "Nsight Systems"
    c._next_check_ns = 0
    c.poll()
    assert lib.enabled == set() and not c.active
    assert c.stats()["yields"] == 2


def test_select_collector_by_mapped_library():
    loaded = []

    def load(name):
        loaded.append(name)
        return types.SimpleNamespace(CuptiCollector=lambda note: "cupti", RocmCollector=lambda note: "rocm")

    assert gpu_mod.select_collector(load, print, {"/x/libcudart.so.13"}) == "cupti"
    assert gpu_mod.select_collector(load, print, {"/opt/rocm/lib/libamdhip64.so.6"}) == "rocm"
    assert gpu_mod.select_collector(load, print, {"/usr/lib/libc.so.6"}) is None


def test_missing_cupti_python_is_a_note_not_an_error(monkeypatch):
    import stacklens.inject.agent.gpu.cupti as cm

    def boom():
        raise ImportError("no cupti")

    monkeypatch.setattr(cm, "_import_cupti", boom)
    notes = []
    c = CuptiCollector(lambda lvl, m: notes.append(m), gpu=fake_gpu())
    assert c.start(lambda k, r: None) is False
    assert "cupti-python is not installed" in notes[0]


@pytest.mark.parametrize("skew", [0, 123_456_789])
def test_clock_calibration(skew):
    import time
    cal = gpu_mod.ClockCalibration(lambda: time.monotonic_ns() + skew)
    assert abs(cal.offset_ns + skew) < 1_000_000
    assert cal.to_mono(time.monotonic_ns() + skew) == pytest.approx(time.monotonic_ns(), abs=2_000_000)


def test_without_api_records_only_kernel_and_copy_activity_and_the_enable_time_is_reported():
    c, lib, notes, rows = make()
    c.api_records = False
    assert c.start(lambda k, r: rows.append((k, r)))
    K = ActivityKind
    assert lib.enabled == {K.CONCURRENT_KERNEL, K.MEMCPY, K.MEMSET}
    assert not any(lib.api_on.values())
    st = c.stats()
    assert st["api_records"] == 0 and st["enabled_at_ns"] > 0
    assert any("join by launch order" in m for _, m in notes)
    c.stop()
    assert lib.enabled == set()


def test_a_detach_while_yielded_never_enables_cupti_again():
    """stop() while the user's profiler owns CUPTI, then the profiler finishes: the detach's last
    poll must not switch collection back on in a target we are leaving."""
    c, lib, notes, rows = make(profiler="torch.profiler")
    assert c.start(lambda k, r: rows.append((k, r))) and not c.active
    c._gpu.state["profiler"] = None
    c.stop()
    c._next_check_ns = 0
    c.poll()
    assert not c.active and lib.enabled == set()


def test_periodic_flush_off_leaves_completed_buffers_to_cuptis_own_period():
    """gpu_flush=False (a benchmark variant): poll() never calls cuptiActivityFlushAll; CUPTI's
    1 s flush period is still set, and the forced flush at detach still happens."""
    c, lib, notes, rows = make()
    c.periodic_flush = False
    assert c.start(lambda k, r: rows.append((k, r)))
    for _ in range(3):
        c._next_check_ns = 0
        c.poll()
    assert lib.flushes == [] and lib.flush_period == 1000
    c.stop()
    assert lib.flushes == [1]


def test_the_collectors_parts_hide_no_cupti_python_call_from_the_doc():
    """docs/agent-in-target.md's inventory (tests/unit/test_agent_doc.py) follows cupti-python's
    module within one file: ``self._lib`` is cupti-python in cupti.py, which imports it, but not in
    the parts that use it too (cupti_raw.py, cupti_rows.py). Read as one file, the collector's
    files call nothing the doc does not name."""
    from tests.unit.test_agent_doc import DOC_PATH, collect, doc_inventory

    gpu_dir = Path(__file__).resolve().parents[2] / "inject" / "agent" / "gpu"
    text = "\n".join(p.read_text() for p in sorted(gpu_dir.glob("cupti*.py")))
    found = collect({"inject/agent/gpu/cupti*.py": text})["vendor"]
    listed = doc_inventory(DOC_PATH.read_text())["vendor"]
    assert {"cuptiGetCallbackName", "cuptiActivityEnable", "cuptiFinalize"} <= set(found)
    assert set(found) <= set(listed), sorted(set(found) - set(listed))
