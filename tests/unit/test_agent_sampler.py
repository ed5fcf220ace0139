"""The frame sampler, in this process."""

import threading
import time

from stacklens.inject.agent.sampler import Sampler


def _spin_in_marker(stop):
    def marker_function():
        while not stop.is_set():
            time.sleep(0.001)
    marker_function()


def test_samples_every_thread_outermost_first_and_skips_itself():
    stop = threading.Event()
    t = threading.Thread(target=_spin_in_marker, args=(stop,))
    t.start()
    try:
        s = Sampler(hz=100, skip_idents={threading.get_ident()})
        rows = s.sample()
    finally:
        stop.set()
        t.join()
    tids = {r[0] for r in rows}
    assert t.native_id in tids and threading.get_native_id() not in tids
    row = next(r for r in rows if r[0] == t.native_id)
    funcs = [f[1] for f in row[2]]
    assert funcs[-1].endswith("marker_function") and funcs[0] == "Thread._bootstrap"


def test_depth_limit_marks_truncated():
    def recurse(n):
        if n == 0:
            return Sampler(max_depth=5).sample()
        return recurse(n - 1)
    rows = recurse(20)
    me = next(r for r in rows if r[0] == threading.get_native_id())
    assert len(me[2]) == 5 and me[3] is True and me[2][-2][1].endswith("recurse")


def test_rate_adapts_when_sampling_is_expensive():
    s = Sampler(hz=100, max_overhead=0.02)
    s.cost_ewma = 0.005            # 5 ms per sample at 10 ms intervals = 50% overhead
    s._adapt()
    assert s.hz < 100
    for _ in range(50):
        s._adapt()
    assert s.hz >= 1.0
    s.cost_ewma = 1e-6
    for _ in range(50):
        s._adapt()
    assert abs(s.hz - 100) < 1e-6
