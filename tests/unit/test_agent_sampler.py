"""The frame sampler, in this process."""

import gc
import json
import socket
import sys
import threading
import time
import types
import weakref

from stacklens.inject.agent import Agent, _SampleBatch, wire
from stacklens.inject.agent.sampler import Sampler
from stacklens.inject.channel.messages import parse_message


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


def _park(ready, stop, seen):
    seen["caller_line"] = sys._getframe(1).f_lineno
    ready.set()
    stop.wait()


def _sample_parked(sampler, target, *args):
    """Rows of one sample taken while a thread is parked inside target(ready, stop, seen, *args)."""
    ready, stop, seen = threading.Event(), threading.Event(), {}
    t = threading.Thread(target=target, args=(ready, stop, seen) + args)
    t.start()
    try:
        ready.wait(5)
        rows = sampler.sample()
    finally:
        stop.set()
        t.join()
    return next(r for r in rows if r[0] == t.native_id)[2], seen


def _two_call_sites(ready, stop, seen, first):
    if first:
        _park(ready, stop, seen)
    else:
        _park(ready, stop, seen)


def test_cached_frames_keep_the_line_of_each_call_site():
    s = Sampler(skip_idents={threading.get_ident()})
    for first in (True, False, True):
        stack, seen = _sample_parked(s, _two_call_sites, first)
        caller = next(f for f in stack if f[1] == "_two_call_sites")
        assert caller == (__file__, "_two_call_sites", seen["caller_line"])
    names = [f[1] for f in stack]
    assert names[names.index("_park") + 1] == "Event.wait"


def test_frame_cache_is_bounded_and_keeps_no_frames_alive():
    class Local:
        pass

    s = Sampler(skip_idents={threading.get_ident()})
    s.MAX_CACHED = 40
    refs = []
    for i in range(60):                 # a distinct code object per round, like generated code
        ns = {"_park": _park}
        exec(f"def gen_{i}(ready, stop, seen, obj):\n    _park(ready, stop, seen)\n", ns)
        obj = Local()
        refs.append(weakref.ref(obj))
        stack, _ = _sample_parked(s, ns[f"gen_{i}"], obj)
        assert [f[1] for f in stack][-4:-2] == [f"gen_{i}", "_park"]
        del obj, ns
        assert len(s._frames) <= s.MAX_CACHED + len(stack) + 16    # one sample's frames at most over
    gc.collect()
    assert all(r() is None for r in refs)                         # the frames' locals are gone
    assert all(type(v) is tuple and [type(x) for x in v] == [str, str, int] for v in s._frames.values())
    assert all(isinstance(c, types.CodeType) for c in s._codes.values())
    # every cached id belongs to a code object the cache holds: no id can be reused meanwhile
    assert all(id(s._codes[k[0]]) == k[0] for k in s._frames)


def test_batch_dedups_stacks_and_encodes_as_before():
    a = (("a.py", "main", 1), ("a.py", "f", 7))
    b = (("a.py", "main", 1), ("a.py", "g", 9))
    batch = _SampleBatch()
    for row in [(10, 1, a, False), (10, 2, a, False), (11, 3, a, True), (10, 4, b, False), (10, 5, a, False),
                (11, 6, tuple(list(a)), False)]:
        assert batch.add(row)
    msg = batch.message()
    assert [r[2] for r in msg["s"]] == [0, 0, 0, 1, 0, 0]
    decoded = json.loads(wire.encode(msg)[4:])
    assert decoded["stacks"] == [[list(f) for f in a], [list(f) for f in b]]
    assert [(p.tid, p.frames, p.truncated) for p in parse_message(decoded)] == [
        (10, a, False), (10, a, False), (11, a, True), (10, b, False), (10, a, False), (11, a, False)]
    batch.clear()
    assert batch.add((10, 7, b, False)) and batch.message()["s"] == [[10, 7, 0, 0]]


def test_a_reused_thread_ident_gets_the_new_threads_native_id():
    s = Sampler(skip_idents={threading.get_ident()})
    seen = []
    for _ in range(5):                  # a joined thread's ident (its pthread_t) is handed out again
        ready, stop = threading.Event(), threading.Event()
        t = threading.Thread(target=lambda: (ready.set(), stop.wait()))
        t.start()
        ready.wait(5)
        rows = s.sample()
        stop.set()
        t.join()
        seen.append((t.ident, t.native_id))
        assert t.native_id in {r[0] for r in rows}
    assert len({i for i, _ in seen}) < len({n for _, n in seen})


def test_agent_loop_wakes_once_per_sample_without_polling_zero():
    """poll() takes whole ms; a wait rounded down to 0 made the loop spin on poll(0), giving the
    GIL away and taking it back thousands of times a second between two samples."""
    a, d = socket.socketpair()
    d.sendall(wire.encode({"t": "config", "sample_hz": 100.0, "gpu": False}))
    agent = Agent(a, "tok")
    timeouts = []      # what poll() itself is asked for, in ms

    class Poller:
        def __init__(self, p):
            self.p = p

        def poll(self, ms):
            timeouts.append(ms)
            return self.p.poll(ms)

        def modify(self, *args):
            return self.p.modify(*args)

    agent.ch.poller = Poller(agent.ch.poller)
    got = bytearray()

    def drain():
        while chunk := d.recv(1 << 16):
            got.extend(chunk)

    reader = threading.Thread(target=drain)
    reader.start()
    th = threading.Thread(target=agent.run)
    th.start()
    time.sleep(1.0)
    agent.stop_requested = True
    th.join(5)
    a.close()
    reader.join(5)
    d.close()
    msgs = wire.decode_all(got)[0]
    samples = sum(len(m["s"]) for m in msgs if m["t"] == "samples")
    assert samples >= 50
    # a wait that ends before its deadline is rounded up, never down to a poll(0): zero only when
    # the loop came back after the deadline already (a late wake, rare)
    assert sum(ms == 0 for ms in timeouts) <= samples // 10 + 3, timeouts
    assert len(timeouts) < 2 * samples + 20       # one wake per sample, plus flushes and sends


def test_the_frame_cache_keeps_a_bounded_number_of_code_objects_alive():
    """Generated code (torch.fx forward(), exec'd per recompile) must not be kept alive without
    bound by the sampler's per-code cache."""
    import threading
    import weakref

    from stacklens.inject.agent.sampler import Sampler

    s = Sampler(hz=100)
    refs = []
    for i in range(Sampler.MAX_CODES + 20):
        ns = {}
        exec(compile(f"def gen_{i}():\n    return sample()\n", f"<gen {i}>", "exec"), {"sample": s.sample}, ns)
        refs.append(weakref.ref(ns[f"gen_{i}"].__code__))
        ns[f"gen_{i}"]()                       # samples with the generated frame on the stack
        del ns
    assert len(s._codes) <= Sampler.MAX_CODES and len(s._frames) <= Sampler.MAX_CACHED
    alive = sum(r() is not None for r in refs)
    assert alive <= Sampler.MAX_CODES, alive   # the oldest were let go


def test_switch_interval_setting_holds_while_attached_and_is_restored():
    """switch_s (a benchmark variant): the GIL switch interval the agent runs under, put back as
    found at detach; an out-of-range value changes nothing."""
    before = sys.getswitchinterval()
    try:
        for want, expect in ((0.004, 0.004), (5.0, before)):
            a, d = socket.socketpair()
            d.sendall(wire.encode({"t": "config", "sample_hz": 50.0, "gpu": False, "switch_s": want}))
            agent = Agent(a, "tok")
            seen = []
            pump = agent.ch.pump
            agent.ch.pump = lambda t: (seen.append(sys.getswitchinterval()), pump(t))[1]
            th = threading.Thread(target=agent.run)
            th.start()
            time.sleep(0.3)
            agent.stop_requested = True
            th.join(5)
            a.close()
            d.close()
            assert not th.is_alive()
            assert seen and abs(seen[-1] - expect) < 1e-6
            assert sys.getswitchinterval() == before
    finally:
        sys.setswitchinterval(before)


def test_switch_interval_is_restored_when_run_raises(monkeypatch):
    """run() failing after it set switch_s (here: the sampler's import) still puts the interval
    back: the bootstrap restores only its own value, so nobody else would."""
    import stacklens.inject.agent as agent_mod

    before = sys.getswitchinterval()
    seen = []
    real_sub = agent_mod._sub

    def failing_sub(name):
        if name == "sampler":
            seen.append(sys.getswitchinterval())
            raise RuntimeError("no sampler")
        return real_sub(name)

    monkeypatch.setattr(agent_mod, "_sub", failing_sub)
    a, d = socket.socketpair()
    try:
        d.sendall(wire.encode({"t": "config", "gpu": False, "switch_s": 0.003}))
        agent = Agent(a, "tok")
        try:
            agent.run()
        except RuntimeError as e:
            assert str(e) == "no sampler"
        else:
            raise AssertionError("run() did not raise")
        assert seen and abs(seen[0] - 0.003) < 1e-6       # it was set when the failure came
        assert sys.getswitchinterval() == before
    finally:
        sys.setswitchinterval(before)
        a.close()
        d.close()


def _notes(agent):
    return [m["msg"] for m in wire.decode_all(bytes(agent.ch.out))[0] if m["t"] == "note"]


def test_switch_interval_out_of_range_changes_nothing_and_says_so():
    before = sys.getswitchinterval()
    try:
        for want in (1e-9, 0.5, 5.0, -0.001):
            a, d = socket.socketpair()
            try:
                agent = Agent(a, "tok", config={"switch_s": want})
                assert agent._set_switch_interval() is None
                assert sys.getswitchinterval() == before
                notes = _notes(agent)
                assert len(notes) == 1 and "switch_s" in notes[0] and "ignored" in notes[0], notes
            finally:
                a.close()
                d.close()
        a, d = socket.socketpair()
        try:
            agent = Agent(a, "tok")                    # 0, the default: silently left alone
            assert agent._set_switch_interval() is None and _notes(agent) == []
        finally:
            a.close()
            d.close()
        assert sys.getswitchinterval() == before
    finally:
        sys.setswitchinterval(before)


def test_config_with_huge_infinite_or_nan_numbers_keeps_the_defaults():
    """A config message never raises into the agent loop: a value that is not finite or does not
    convert to the setting's type (int(inf), int(nan), float(10**400)) is skipped."""
    from stacklens.inject.agent import DEFAULTS

    inf, nan = float("inf"), float("nan")
    bad = {"sample_hz": 10 ** 400, "max_depth": inf, "max_overhead": nan, "flush_ms": nan,
           "max_outbox": -inf, "max_gpu_queue": inf, "max_raw_bytes": nan, "switch_s": inf}
    a, d = socket.socketpair()
    try:
        agent = Agent(a, "tok", config=bad)
        assert agent.cfg == DEFAULTS
        outbox, gpu_queue = agent.ch.max_outbox, agent.gpu.max_queue
        agent._handle([dict(bad, t="config")])
        assert agent.cfg == DEFAULTS
        assert (agent.ch.max_outbox, agent.gpu.max_queue) == (outbox, gpu_queue)
        agent._handle([{"t": "config", "sample_hz": 10 ** 400, "max_depth": 64, "switch_s": 0.002}])
        assert agent.cfg["max_depth"] == 64 and agent.cfg["switch_s"] == 0.002   # the good ones apply
        assert agent.cfg["sample_hz"] == DEFAULTS["sample_hz"]
    finally:
        a.close()
        d.close()


def test_module_forwards_carry_their_attribute_path_and_class():
    torch = __import__("pytest").importorskip("torch")

    class Attn(torch.nn.Module):
        def forward(self, ready, stop):
            ready.set()
            stop.wait()

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = Attn()

        def forward(self, ready, stop):
            return self.attn(ready, stop)

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.h = torch.nn.ModuleList([Block(), Block()])

        def forward(self, ready, stop):
            return self.h[1](ready, stop)

    model, ready, stop = Model(), threading.Event(), threading.Event()
    t = threading.Thread(target=model, args=(ready, stop))
    t.start()
    try:
        ready.wait(30)
        s = Sampler(skip_idents={threading.get_ident()}, module_paths=True)
        first, again = (next(r for r in s.sample() if r[0] == t.native_id)[2] for _ in range(2))
    finally:
        stop.set()
        t.join()
    named = [f[3:] for f in first if len(f) == 5]
    assert named == [("", "Model"), ("h.1", "Block"), ("h.1.attn", "Attn")]
    assert [f[1] for f in first if len(f) == 5][-1].endswith("Attn.forward")
    assert all(a is b for a, b in zip(first, again))      # shared tuples: the batch's fast path
    # one walk per root, weakly held: the model goes when the program drops it
    ref = weakref.ref(model)
    del model, t
    gc.collect()
    assert ref() is None


def test_module_naming_never_raises_and_skips_what_is_not_a_module():
    class Odd:
        def forward(self, ready, stop):
            ready.set()
            stop.wait()

    ready, stop = threading.Event(), threading.Event()
    t = threading.Thread(target=Odd().forward, args=(ready, stop))
    t.start()
    try:
        ready.wait(30)
        s = Sampler(skip_idents={threading.get_ident()}, module_paths=True)
        stack = next(r for r in s.sample() if r[0] == t.native_id)[2]
        s._walk(object())                  # no __dict__ of modules: an empty walk, no error
    finally:
        stop.set()
        t.join()
    assert all(len(f) == 3 for f in stack)


def _forward_rebinding_a_local(module_paths):
    """A module-like forward holds a local, is sampled, then rebinds it: does the local die at
    once (as without a profiler), or does the sample keep it alive until the call returns?"""
    import weakref

    class Big:
        pass

    sampled, rebound = threading.Event(), threading.Event()
    box = {}

    class Mod:
        def forward(self, ready):
            x = Big()
            box["ref"] = weakref.ref(x)
            ready.set()
            sampled.wait(30)
            x = None                           # the target drops its only reference
            box["alive_after_rebind"] = box["ref"]() is not None
            rebound.set()
            return x

    ready = threading.Event()
    t = threading.Thread(target=Mod().forward, args=(ready,), daemon=True)
    t.start()
    assert ready.wait(30)
    s = Sampler(skip_idents={threading.get_ident()}, module_paths=module_paths)
    s._module_cls = Mod                        # stands in for torch.nn.Module
    s.sample()
    sampled.set()
    assert rebound.wait(30)
    t.join(30)
    return box["alive_after_rebind"]


def test_sampling_never_extends_a_local_s_life_by_default():
    """The guest rule: a local the target drops dies at once while the agent samples. Before
    3.13, reading a frame's ``self`` (module paths) copies every local into the frame and keeps
    them until the call returns, so module paths are off there by default."""
    import sys
    from stacklens.inject.agent.sampler import MODULE_PATHS_DEFAULT

    assert MODULE_PATHS_DEFAULT == (sys.version_info >= (3, 13))
    assert _forward_rebinding_a_local(MODULE_PATHS_DEFAULT) is False
    if sys.version_info < (3, 13):   # what the default avoids, shown: the copy keeps the local alive
        assert _forward_rebinding_a_local(True) is True
