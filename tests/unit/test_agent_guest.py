"""The agent is a guest: it never changes when a target's object dies, and it never tears CUPTI
down where CUDA graphs may replay (docs/agent-in-target.md)."""

import dataclasses
import gc
import sys
import types
import weakref

from stacklens.inject.agent import inductor
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

    monkeypatch.setattr(inductor.gc, "get_referrers", referrers_then_target_drops)
    assert w._scan_graphs() is True
    assert w.graphs == {"ckey": graph.inductor_post_grad_graph_str}
    assert seen == {"alive_after_drop": False}
