"""The GPU join interface (daemon/join/gpujoin.py): both joins implement it, and on the same calls and
records they reach the same verdicts through `Charges`, each by its own rule."""

from __future__ import annotations

import inspect

import pytest

from stacklens.daemon.join.apijoin import ApiRecordJoin
from stacklens.daemon.join.charges import GpuCharges
from stacklens.daemon.join.gpujoin import Charges, CopyCall, GpuJoin
from stacklens.daemon.join.orderjoin import SETTLE_NS, LaunchOrderJoin
from stacklens.records.agent import ApiRecord, KernelRecord, MemcpyRecord
from tests.fakes.sources import FakeEvent

JOINS = (ApiRecordJoin, LaunchOrderJoin)
DIMS = dict(grid_x=4, grid_y=1, grid_z=1, block_x=128, block_y=1, block_z=1)


def _methods(proto: type) -> dict[str, inspect.Signature]:
    return {n: inspect.signature(f) for n, f in vars(proto).items()
            if callable(f) and not n.startswith("_")}


@pytest.mark.parametrize("cls", JOINS)
def test_each_join_implements_every_method_of_the_interface(cls):
    for name, sig in _methods(GpuJoin).items():
        assert list(inspect.signature(getattr(cls, name)).parameters) == list(sig.parameters), name


def test_the_joiners_charges_take_every_verdict_of_the_interface():
    for name, sig in _methods(Charges).items():
        assert list(inspect.signature(getattr(GpuCharges, name)).parameters) == list(sig.parameters), name


class Verdicts:
    """A `Charges` that writes down what it is told."""

    def __init__(self):
        self.seen: list[tuple] = []

    def kernel(self, path, rec):
        self.seen.append(("kernel", path, rec.correlation_id))

    def kernel_unseen(self, rec):
        self.seen.append(("kernel_unseen", rec.correlation_id))

    def kernel_lost(self):
        self.seen.append(("kernel_lost",))

    def launch_dropped(self):
        self.seen.append(("launch_dropped",))

    def copy(self, path, rec):
        self.seen.append(("copy", path, rec.correlation_id))

    def copy_unseen(self, rec):
        self.seen.append(("copy_unseen", rec.correlation_id))

    def copy_dropped(self, call):
        self.seen.append(("copy_dropped", call.path))


class Clock:
    t = 10.0

    def __call__(self):
        return self.t


def _launch(t):
    ev = FakeEvent(kind="launch", tid=1, ktime_ns=t, api="cuLaunchKernel")
    object.__setattr__(ev, "args", dict(DIMS))
    return ev


@pytest.mark.parametrize("cls", JOINS)
def test_both_joins_give_a_kernel_and_a_copy_to_the_call_that_issued_them(cls):
    v, clock = Verdicts(), Clock()
    j = cls(v, clock)
    j.on_enabled(1)
    j.on_launch(_launch(1_000), ("launch path",))
    call = CopyCall(2_000, ("copy path",), 64, "memcpy")
    j.on_copy_call(FakeEvent(kind="memcpy", tid=1, ktime_ns=2_000), call)
    j.on_api(ApiRecord("driver", "cuLaunchKernel", 1, 900, 1_100, 7))
    j.on_api(ApiRecord("driver", "cuMemcpyAsync", 1, 1_900, 2_100, 8))
    j.on_kernel(KernelRecord("k", 1_500, 1_600, 0, 7, 7, (4, 1, 1), (128, 1, 1)))
    j.on_copy(MemcpyRecord("HtoD", 64, 2_500, 2_600, 0, 7, 8))
    clock.t += SETTLE_NS / 1e9 + 1
    j.expire(int(clock.t * 1e9))
    j.finish()
    assert v.seen == [("kernel", ("launch path",), 7), ("copy", ("copy path",), 8)]
    assert j.waiting_launches() == 0


def test_a_launch_no_record_claims_is_still_waiting_after_the_finish():
    """What a window counts as unjoined: the order join said 0 here, whatever it still held."""
    v, clock = Verdicts(), Clock()
    j = LaunchOrderJoin(v, clock)
    j.on_enabled(1)
    j.on_launch(_launch(1_000), ("claimed",))
    j.on_launch(_launch(3_000), ("never claimed",))
    j.on_api(ApiRecord("driver", "cuLaunchKernel", 1, 900, 1_100, 7))
    j.on_kernel(KernelRecord("k", 1_500, 1_600, 0, 7, 7, (4, 1, 1), (128, 1, 1)))
    j.finish()
    assert ("kernel", ("claimed",), 7) in v.seen
    assert j.waiting_launches() == 1
