"""Event: the loader's immutable record keeps the frozen-dataclass behaviour callers relied on."""

from __future__ import annotations

import copy
import pickle

import pytest

from stacklens.records.events import Event, make_event
from stacklens.bpf.spec import DEFAULT_SPEC, load_specs


def test_keyword_constructor_defaults_and_fields():
    e = Event(kind="cpu_sample", api="", pid=1, tid=2, ktime_ns=3)
    assert (e.kind, e.api, e.pid, e.tid, e.ktime_ns) == ("cpu_sample", "", 1, 2, 3)
    assert (e.duration_ns, e.args, e.op_path, e.native_stack, e.py_stack) == (0, {}, (), (), ())
    assert (e.kernel_name, e.bytes, e.direction, e.ret, e.py_entries) == ("", 0, "", 0, ())
    assert e == make_event("cpu_sample", "", 1, 2, 3, 0, {}, (), (), ())


def test_immutable():
    e = Event("launch", "cuLaunchKernel", 1, 2, 3)
    with pytest.raises(AttributeError):
        e.tid = 5  # type: ignore[misc]
    with pytest.raises(AttributeError):
        e.extra = 1  # type: ignore[attr-defined]


def test_equality_and_hash_ignore_args_and_py_entries():
    a = Event("launch", "cuLaunchKernel", 1, 2, 3, args={"f": 1}, py_entries=(True,))
    b = Event("launch", "cuLaunchKernel", 1, 2, 3, args={"f": 2}, py_entries=(False,))
    c = Event("launch", "cuLaunchKernel", 1, 2, 4)
    assert a == b and hash(a) == hash(b) and not (a != b)
    assert a != c
    assert len({a, b, c}) == 2
    assert a != ("launch", "cuLaunchKernel", 1, 2, 3)  # not equal to a plain tuple
    with pytest.raises(TypeError):
        _ = a < c


def test_lazy_raw_args_decode_like_the_spec():
    spec = next(s for s in load_specs(DEFAULT_SPEC) if s.symbol == "cuLaunchKernel")
    raw = (0x1234, 1 | (2 << 32), 3, 4, 5, 6, 7, 8, 9, 10, 11, 0)
    e = make_event("launch", spec.symbol, 1, 2, 3, 0, (spec, raw, b""), (), (), (), "k")
    assert e.args == spec.decode(raw, b"")
    assert e.args["f"] == 0x1234
    assert "args={'f': 4660" in repr(e)
    for clone in (pickle.loads(pickle.dumps(e)), copy.copy(e), copy.deepcopy(e)):
        assert clone == e and clone.args == e.args and type(clone) is Event
