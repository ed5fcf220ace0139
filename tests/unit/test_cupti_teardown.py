"""The CUPTI collector's teardown at detach against the fake libcupti built from C
(tests/fakes/fake_cupti.c, also mapped as libcudart through a symlink): cuptiFinalize only in the
exit callback of the agent's own runtime call; skipped, with a note, below CUDA 12.6 and while
someone else holds CUPTI's one subscriber; whatever step fails, activities stay off, no subscriber
of ours is left and the target goes on; a second attach after a finalize registers its buffers
again and gets records."""

import ctypes
import os
import socket
import struct
import types

import pytest

import stacklens.inject.agent as agent_mod
from stacklens.inject.agent import Agent
from stacklens.inject.agent.gpu import cupti_teardown
from stacklens.inject.agent.gpu.cupti import CuptiCollector
from tests.unit.test_agent_cupti import fake_gpu
from tests.unit.test_agent_cupti_raw import KERNEL, RawCupti, kernel
from tests.unit.test_cupti_raw_ctypes import libcupti  # noqa: F401 - the fixture


@pytest.fixture(autouse=True)
def no_graph_users(monkeypatch):
    """These tests are about the teardown itself: where graphs may replay it is skipped
    (``graph_users``, tested in test_agent_guest.py), and another test may have loaded JAX."""
    monkeypatch.setattr(cupti_teardown, "graph_users", lambda modules=None: None)


@pytest.fixture(scope="module")
def libs(libcupti):  # noqa: F811 - the fixture
    cudart = os.path.join(os.path.dirname(libcupti), "libcudart.so.13")
    os.symlink(os.path.basename(libcupti), cudart)   # one file: one copy of the fake's state
    yield libcupti, cudart
    if hasattr(ctypes, cupti_teardown._FINALIZERS):
        delattr(ctypes, cupti_teardown._FINALIZERS)


@pytest.fixture
def fake(libs):
    lib = ctypes.CDLL(libs[0])
    lib.fake_cupti_reset()
    yield lib
    lib.fake_cupti_reset()


def set_(fake, **values):
    for k, v in values.items():
        fake.fake_cupti_set(k.encode(), v)


def get(fake, name):
    return fake.fake_cupti_get(name.encode())


def attach(libs, **kw):
    """A collector on the raw path with the real ctypes callbacks on the fake, started."""
    g = fake_gpu()
    g.mapped_libraries = lambda: set(libs)
    notes, sunk = [], []
    c = CuptiCollector(lambda lvl, msg: notes.append((lvl, msg)), lib=RawCupti(), gpu=g)
    c.api_records = False
    for k, v in kw.items():
        setattr(c, k, v)
    assert c.start(lambda k, r: sunk.append((k, r)))
    return c, notes, sunk


def teardown_notes(notes):
    return [(lvl, m) for lvl, m in notes if "finalize" in m or "left initialised" in m]


def test_finalize_in_the_exit_callback_of_our_runtime_call_and_only_there(libs, fake):
    c, notes, _ = attach(libs)
    c.stop()
    assert get(fake, "finalize_at_exit") == 1 and get(fake, "finalize_elsewhere") == 0
    assert get(fake, "entry_callbacks") == 1 and get(fake, "exit_callbacks") == 1  # entry: ignored
    assert fake.fake_cupti_subscribed() == 0 and c._lib.enabled == set()
    assert teardown_notes(notes) == [("info", "cupti finalized: CUPTI's API hooks are out of the process")]
    assert c.stats()["finalized"] == 1


def test_a_second_attach_after_finalize_registers_its_buffers_again_and_gets_records(libs, fake):
    c, _, _ = attach(libs)
    regs = fake.fake_cupti_registrations()
    c.stop()
    data = kernel(1, 100, 200)
    fake.fake_cupti_stage(data, ctypes.c_size_t(len(data)), ctypes.c_uint32(10), ctypes.c_size_t(KERNEL.itemsize))
    c._raw_cb.flush_all(1)        # finalized: CUPTI forgot the buffer callbacks
    c2, notes2, sunk2 = attach(libs)
    assert fake.fake_cupti_registrations() == regs + 1
    c2._next_check_ns = 0
    c2.poll()
    (kind, (head, body)), = [s for s in sunk2 if s[0] == "raw"]
    n_offs = head["n_offs"]
    assert body[4 * n_offs:] == data and struct.unpack("<I", body[:4]) == (0,)
    c2.stop()
    assert get(fake, "finalize_at_exit") == 2 and get(fake, "finalize_elsewhere") == 0
    assert ("info", "cupti finalized: CUPTI's API hooks are out of the process") in notes2


def test_skipped_with_a_note_while_someone_else_holds_the_subscriber(libs, fake):
    """Kineto keeps its subscriber once torch.profiler has run: cuptiSubscribe returns 39 and
    CUPTI, theirs, is left alone."""
    theirs = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_uint32, ctypes.c_uint32, ctypes.c_void_p)(
        lambda *a: None)
    handle = ctypes.c_void_p()
    assert fake.cuptiSubscribe(ctypes.byref(handle), theirs, None) == 0
    c, notes, _ = attach(libs)
    c.stop()
    (lvl, msg), = teardown_notes(notes)
    assert lvl == "info" and "the user's profiler holds CUPTI's subscriber" in msg
    assert get(fake, "finalize_at_exit") + get(fake, "finalize_elsewhere") == 0
    assert fake.fake_cupti_subscribed() == 1 and fake.cuptiUnsubscribe(handle) == 0   # still theirs
    assert c._lib.enabled == set() and c.stats()["finalized"] == 0


@pytest.mark.parametrize("values", [{"version": 23}, {"driver": 12050}])
def test_skipped_below_cuda_12_6(libs, fake, values):
    set_(fake, **values)
    c, notes, _ = attach(libs)
    c.stop()
    (lvl, msg), = teardown_notes(notes)
    assert lvl == "info" and "CUDA < 12.6" in msg
    assert get(fake, "exit_callbacks") == 0 and fake.fake_cupti_subscribed() == 0


@pytest.mark.parametrize("values, why", [
    ({"fail_version": 17}, "CUDA < 12.6 (CUPTI API version 0"),
    ({"fail_name": 3}, "is not cudaRuntimeGetVersion here"),
    ({"fail_subscribe": 15}, "cuptiSubscribe returned 15"),
    ({"fail_enable": 7}, "cuptiEnableCallback returned 7"),
    ({"silent": 1}, "no exit callback of the runtime call"),
    ({"silent": 1, "fail_unsubscribe": 5}, "(and cuptiUnsubscribe returned 5)"),
    ({"fail_finalize": 99}, "cuptiFinalize returned 99"),
])
def test_a_failing_step_leaves_activities_off_and_the_target_running(libs, fake, values, why):
    set_(fake, **values)
    c, notes, _ = attach(libs)
    c.stop()                                      # never raises
    (lvl, msg), = teardown_notes(notes)
    assert why in msg and msg.startswith("CUPTI finalize skipped"), msg
    assert c._lib.enabled == set() and not c.active and c.stats()["finalized"] == 0
    assert fake.fake_cupti_subscribed() == ("fail_unsubscribe" in values)   # ours only if it could not go
    v = ctypes.c_int()
    assert fake.cudaRuntimeGetVersion(ctypes.byref(v)) == 0 and v.value == 13000   # the target's calls work


def test_nothing_is_tried_while_the_users_profiler_is_active_or_with_gpu_finalize_off(libs, fake):
    c, notes, _ = attach(libs)
    c._gpu.state["profiler"] = "torch.profiler"        # started after our last check
    c.stop()
    c2, notes2, _ = attach(libs, finalize=False)
    c2.stop()
    assert "torch.profiler is active in the target" in teardown_notes(notes)[0][1]
    assert teardown_notes(notes2) == [("info", "CUPTI left initialised at detach (gpu_finalize off): "
                                               "its API hooks stay")]
    assert get(fake, "exit_callbacks") == 0 and fake.fake_cupti_subscribed() == 0


def test_gpu_finalize_from_the_daemons_config_reaches_the_collector(monkeypatch):
    col = types.SimpleNamespace(finalize=True, start=lambda sink: True)
    monkeypatch.setattr(agent_mod, "_sub", lambda name, real=agent_mod._sub:
                        types.SimpleNamespace(select_collector=lambda load, note: col)
                        if name == "gpu" else real(name))
    a, d = socket.socketpair()
    try:
        assert Agent(a, "tok").cfg["gpu_finalize"] is True                      # on by default
        assert Agent(a, "tok", config={"gpu_finalize": 0}).cfg["gpu_finalize"] is True   # not a bool
        agent = Agent(a, "tok", config={"gpu_finalize": False})
        agent.gpu.start(agent_mod._sub, agent._note_error)
        assert agent.gpu.collector is col and col.finalize is False
    finally:
        a.close()
        d.close()


def test_a_static_cuda_runtime_has_no_call_to_trigger_it_and_says_so(libs, fake):
    c, notes, _ = attach(libs[:1])                          # libcupti mapped, no libcudart
    c.stop()
    (lvl, msg), = teardown_notes(notes)
    assert lvl == "info" and "no libcudart mapped" in msg and fake.fake_cupti_subscribed() == 0
