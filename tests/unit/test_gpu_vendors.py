"""GPU vendors as pairs (inject/gpu): every registered vendor has a collector in the agent's tree
and a decoder on the daemon side, declares its joins, and the session picks its join from that
declaration; the injected agent loads each collector from its folder."""

from __future__ import annotations

import ast
import importlib
import os
import sys
import types
from pathlib import Path

import pytest

from stacklens.inject import AgentServer
from stacklens.inject import gpu as vendors
from stacklens.inject.agent import gpu as agent_gpu
from stacklens.inject.gpu import JOINS, VENDORS, Vendor, pick_join, vendor_for
from stacklens.inject.gpu.rows import ROW_KINDS

REPO = Path(__file__).parents[2]


def test_each_vendor_has_both_halves_and_declares_capabilities():
    assert set(vendors.collector_names()) == set(VENDORS) == {"cupti", "rocm"}
    classes = {name: cls for name, cls, _libs in agent_gpu.COLLECTORS}
    for name, v in VENDORS.items():
        assert v.name == name
        assert (REPO / "inject/agent/gpu" / f"{name}.py").is_file()      # collector: agent tree
        assert (REPO / "inject/gpu" / f"{name}.py").is_file()            # decoder: daemon side
        collector = importlib.import_module("stacklens.inject.agent." + v.collector)
        cls = getattr(collector, classes[name])
        assert cls.name == name
        for method in ("start", "poll", "stop", "stats"):
            assert callable(getattr(cls, method)), (name, method)
        decoder = importlib.import_module(v.decoder)
        assert callable(decoder.decode) and decoder.MESSAGES
        assert v.joins and set(v.joins) <= set(JOINS) and len(set(v.joins)) == len(v.joins)
        assert type(v.raw_buffers) is bool
        raw_kinds = set(decoder.MESSAGES) - set(ROW_KINDS)
        assert bool(raw_kinds) == v.raw_buffers, name
        if v.raw_buffers:
            assert callable(decoder.parse_layout) and callable(decoder.parse_raw)
    assert VENDORS["cupti"].joins == ("order", "api_records") and VENDORS["cupti"].raw_buffers
    assert VENDORS["rocm"].joins == ("api_records",) and not VENDORS["rocm"].raw_buffers


def test_collectors_import_nothing_of_stacklens():
    """They run in the target under a synthetic package name: stdlib only, siblings via _agent()."""
    for name in VENDORS:
        tree = ast.parse((REPO / "inject/agent/gpu" / f"{name}.py").read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                assert node.level == 0 and not (node.module or "").startswith("stacklens"), (name, node.module)
            elif isinstance(node, ast.Import):
                assert not any(a.name.startswith("stacklens") for a in node.names), name


def test_vendor_for_follows_the_agents_own_choice():
    loaded = []

    def load(name):
        loaded.append(name)
        return types.SimpleNamespace(CuptiCollector=lambda note: "cupti", RocmCollector=lambda note: "rocm")

    for libs, want in (({"/x/libcudart.so.13"}, "cupti"), ({"/usr/lib/libcuda.so.1"}, "cupti"),
                       ({"/opt/rocm/lib/libamdhip64.so.6"}, "rocm"), ({"/usr/lib/libc.so.6"}, None)):
        v = vendor_for(libs)
        assert (v.name if v else None) == want == agent_gpu.select_collector(load, print, libs)
    assert loaded == ["gpu.cupti", "gpu.cupti", "gpu.rocm"]


def test_pick_join_reads_the_declaration():
    cupti, rocm = VENDORS["cupti"], VENDORS["rocm"]
    assert pick_join(cupti, False) == "order" and pick_join(cupti, True) == "api_records"
    assert pick_join(rocm, False) == pick_join(rocm, True) == "api_records"
    assert pick_join(None, False) == "order" and pick_join(None, True) == "api_records"   # as before
    only_order = Vendor("x", joins=("order",), raw_buffers=False)
    assert pick_join(only_order, True) == "order"


def _session(vendor, api_records):
    from stacklens.bpf.report import AttachReport
    from stacklens.daemon.session import ProcessSession

    report = AttachReport(os.getpid(), (), 0, 99, 0.0, python_stacks=True)
    probes = type("P", (), {"attach": lambda self: report, "poll": lambda self, *a, **k: [],
                            "detach": lambda self: None, "stats": lambda self: {}})()
    asked = []

    def agent_factory(pid, **kw):
        asked.append(kw)
        return type("A", (), {"poll": lambda self, *a: [], "stop": lambda self: True, "close": lambda self: None})()

    s = ProcessSession(os.getpid(), agent=True, probe_factory=lambda pid, **kw: probes, agent_factory=agent_factory,
                       gpu_api_records=api_records, gpu_vendor=vendor)
    s.start()
    s.stop()
    return s, asked[0]


def test_the_session_picks_the_join_from_the_declaration(monkeypatch):
    from stacklens.daemon.join.apijoin import ApiRecordJoin
    from stacklens.daemon.join.orderjoin import LaunchOrderJoin

    s, kw = _session("cupti", False)
    assert s.gpu_join == "order" and type(s.joiner.gpu_join) is LaunchOrderJoin and "gpu_api_records" not in kw
    s, kw = _session("cupti", True)
    assert type(s.joiner.gpu_join) is ApiRecordJoin and kw["gpu_api_records"] is True
    s, kw = _session("rocm", False)     # ROCm declares the API-record join only
    assert s.gpu_join == "api_records" and type(s.joiner.gpu_join) is ApiRecordJoin
    assert kw["gpu_api_records"] is True
    # a new vendor's declaration, not its name, decides
    monkeypatch.setitem(VENDORS, "newgpu", Vendor("newgpu", joins=("order",), raw_buffers=False))
    s, kw = _session("newgpu", True)
    assert type(s.joiner.gpu_join) is LaunchOrderJoin and "gpu_api_records" not in kw


def test_the_session_detects_the_vendor_from_the_targets_libraries():
    from stacklens.daemon import session as session_mod
    from stacklens.introspect.procfs import Mapping

    class Maps:
        def __init__(self, paths):
            self.paths = paths

        def maps(self, pid):
            return [Mapping(0, 1, "r-xp", 0, 1, p) for p in self.paths]

    assert session_mod.detect_gpu_vendor(1, Maps(["/opt/rocm/lib/libamdhip64.so.6", "[heap]", ""])) is VENDORS["rocm"]
    assert session_mod.detect_gpu_vendor(1, Maps(["/x/libcudart.so.12"])) is VENDORS["cupti"]
    assert session_mod.detect_gpu_vendor(1, Maps(["/usr/lib/libc.so.6"])) is None


@pytest.fixture
def injected_agent(tmp_path):
    """The agent's code as AgentServer installs it for a target, loaded as the bootstrap loads it."""
    srv = AgentServer(os.getpid(), tmp_path / "agents", config={"gpu": False})
    name = "_stacklens_agent_vendors"
    d = srv.target_agent_dir
    try:
        m = types.ModuleType(name)
        m.__file__ = d + "/__init__.py"
        m.__path__ = [d]
        m.__package__ = name
        sys.modules[name] = m
        with open(m.__file__, "rb") as f:
            exec(compile(f.read(), m.__file__, "exec"), m.__dict__)
        yield d, m
    finally:
        for n in [n for n in list(sys.modules) if n.split(".")[0] == name]:
            sys.modules.pop(n, None)
        srv.close()


def test_the_injected_agent_loads_each_collector_from_its_folder(injected_agent):
    d, m = injected_agent
    assert sorted(os.listdir(d + "/gpu")) == sorted(p.name for p in (REPO / "inject/agent/gpu").glob("*.py"))
    gpu = m._sub("gpu")
    assert gpu.__name__ == m.__name__ + ".gpu" and gpu.__file__ == d + "/gpu/__init__.py"
    for vendor, cls, _libs in gpu.COLLECTORS:
        mod = m._sub("gpu." + vendor)
        assert mod.__file__ == f"{d}/gpu/{vendor}.py" and mod.__package__ == m.__name__ + ".gpu"
        assert getattr(mod, cls).name == vendor
        assert mod._agent("gpu") is gpu and mod._agent("wire") is m._sub("wire")
    c = gpu.select_collector(m._sub, print, {"/x/libcudart.so.13"})
    assert type(c).__module__ == m.__name__ + ".gpu.cupti"
