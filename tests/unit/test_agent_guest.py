"""The agent is a guest: it never changes when a target's object dies, and it never tears CUPTI
down where CUDA graphs may replay (docs/agent-in-target.md)."""

import dataclasses
import gc
import sys
import types
import weakref

from stacklens.inject.agent import heapscan, inductor, jaxmeta
from stacklens.inject.agent.gpu.cupti_teardown import graph_users


class _Tensorish:
    """Stands for a tensor: weak-referenceable, tracked by the GC, no references of its own."""

    def __init__(self):
        self.payload = [0]


def test_graph_users_names_jax_and_live_cuda_graphs():
    assert graph_users({}) is None
    assert "jaxlib" in graph_users({"jaxlib": types.ModuleType("jaxlib")})

    class CUDAGraph:
        pass

    class Subclassed(CUDAGraph):     # a graph of a subclass counts too (cudagraph trees, servers)
        pass

    mod = types.ModuleType("torch.cuda.graphs")
    mod.CUDAGraph = CUDAGraph
    assert graph_users({"torch.cuda.graphs": mod}) is None      # the class alone: no graph exists
    g = Subclassed()
    assert graph_users({"torch.cuda.graphs": mod}) == "1 torch.cuda.CUDAGraph object(s) alive"
    del g
    assert graph_users({"torch.cuda.graphs": mod}) is None


def test_the_collector_skips_finalize_while_graphs_may_replay(monkeypatch):
    from stacklens.inject.agent.gpu import cupti as cupti_mod
    from stacklens.inject.agent.gpu import cupti_teardown

    class Gpu:
        @staticmethod
        def user_profiler_active(maps=None):
            return None

        @staticmethod
        def mapped_libraries():
            return ["/x/libcupti.so.13", "/x/libcudart.so.13"]

    def no_finalizer(*a):
        raise AssertionError("finalize must not be reached while graphs may replay")

    monkeypatch.setattr(cupti_teardown, "_finalizer", no_finalizer)
    monkeypatch.setitem(sys.modules, "jaxlib", types.ModuleType("jaxlib"))
    c = cupti_mod.CuptiCollector(lambda *a: None, gpu=Gpu())
    level, why = c._finalize()
    assert level == "info" and "jaxlib is loaded" in why and "graph replays" in why


def test_inductor_graph_scan_holds_no_other_object_of_the_target(monkeypatch):
    """The scan finds CompiledFxGraph's post-grad graphs, and an object the target drops while the
    agent thread scans dies at once, on the target's thread (gc.get_objects() kept it alive)."""

    @dataclasses.dataclass
    class CompiledFxGraph:
        cache_key: str
        inductor_post_grad_graph_str: str

    mod = types.ModuleType("torch._inductor.output_code")
    mod.CompiledFxGraph = CompiledFxGraph
    monkeypatch.setitem(sys.modules, "torch._inductor.output_code", mod)
    graph = CompiledFxGraph("ckey", "# File: m.py:3 in forward, code: x\n    relu = ...\n")

    monkeypatch.setattr(heapscan, "MAX_SCAN_BLOCKS", sys.maxsize)   # whatever the suite's heap holds
    w = inductor.InductorWatcher(lambda m: True, lambda *a: None, clock=lambda: 0.0)
    held = _Tensorish()
    ref = weakref.ref(held)
    seen = {}
    real = gc.get_referrers

    def referrers_then_target_drops(*objs):   # the target runs while the agent holds the result
        out = real(*objs)
        nonlocal held
        held = None
        seen["alive_after_drop"] = ref() is not None
        return out

    monkeypatch.setattr(heapscan.gc, "get_referrers", referrers_then_target_drops)
    assert w._scan_graphs() is True
    assert w.graphs == {"ckey": graph.inductor_post_grad_graph_str}
    assert seen == {"alive_after_drop": False}


def test_no_heap_walk_over_the_bound_and_a_note_says_what_was_not_read(monkeypatch):
    """Over heapscan.MAX_SCAN_BLOCKS the Inductor reader and the JAX watcher do not walk the heap
    (a walk stops the job's threads in proportion to it); each says once what it did not read."""
    class CompiledFxGraph:
        pass

    mod = types.ModuleType("torch._inductor.output_code")
    mod.CompiledFxGraph = CompiledFxGraph
    monkeypatch.setitem(sys.modules, "torch._inductor.output_code", mod)
    keep = CompiledFxGraph()
    walks = []
    real = gc.get_referrers
    monkeypatch.setattr(heapscan.gc, "get_referrers", lambda *c: walks.append(c) or real(*c))
    monkeypatch.setattr(heapscan, "MAX_SCAN_BLOCKS", sys.maxsize)
    assert heapscan.instances((CompiledFxGraph,)) == [keep] and len(walks) == 1   # under the bound
    monkeypatch.setattr(heapscan, "MAX_SCAN_BLOCKS", sys.getallocatedblocks() // 2)
    assert heapscan.instances((CompiledFxGraph,)) is None and len(walks) == 1
    notes = []
    now = [0.0]
    w = inductor.InductorWatcher(lambda m: True, lambda level, text: notes.append(text), clock=lambda: now[0])
    assert w._scan_graphs() is True and w.graphs == {}       # the modules go on, without graphs
    now[0] += 3600
    assert w._scan_graphs() is True and w.scan_skipped == 2 and len(walks) == 1
    assert len(notes) == 1 and "post-grad graphs not read" in notes[0]

    pxla = types.ModuleType("jax._src.interpreters.pxla")
    pxla.MeshExecutable = CompiledFxGraph
    monkeypatch.setitem(sys.modules, "jax._src.interpreters.pxla", pxla)
    jnotes = []
    watcher = jaxmeta.JaxWatcher(lambda m: True, lambda level, text: jnotes.append(text))
    watcher._scan_existing()
    assert not watcher.queue and len(walks) == 1 and "compiled before the attach not looked for" in jnotes[0]


def test_the_inductor_walks_take_at_most_a_thousandth_of_the_time(monkeypatch):
    """A walk that took W seconds is not made again within 1000 W (nor within GC_SCAN_S)."""
    class CompiledFxGraph:
        pass

    mod = types.ModuleType("torch._inductor.output_code")
    mod.CompiledFxGraph = CompiledFxGraph
    monkeypatch.setitem(sys.modules, "torch._inductor.output_code", mod)
    monkeypatch.setattr(heapscan, "MAX_SCAN_BLOCKS", sys.maxsize)
    now = [100.0]
    w = inductor.InductorWatcher(lambda m: True, lambda *a: None, clock=lambda: now[0])
    assert w._scan_graphs() is True
    w.walk_s = 0.05                          # as if that walk had taken 50 ms: the next after 50 s
    now[0] += inductor.GC_SCAN_S + 1
    assert w._scan_graphs() is False
    now[0] += 40
    assert w._scan_graphs() is True

