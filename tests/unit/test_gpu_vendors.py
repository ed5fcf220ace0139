"""GPU vendors as pairs (inject/channel/gpu): every registered vendor has a collector in the agent's tree
and a decoder on the daemon side, declares its joins, and the session picks its join from that
declaration; the agent server hands every GPU message to the declared decoder; the injected agent
loads each collector from its folder."""

from __future__ import annotations

import ast
import importlib
import os
import sys
import types
from pathlib import Path

import pytest

from stacklens.inject.channel.server import AgentServer
from stacklens.inject.channel import gpu as vendors
from stacklens.inject.agent import gpu as agent_gpu
from stacklens.inject.agent import wire
from stacklens.inject.channel.gpu import JOINS, VENDORS, Connection, Vendor, pick_join, route, vendor_for
from stacklens.inject.channel.gpu.rows import ROW_KINDS
from stacklens.records.agent import ApiRecord, JoinKind, KernelRecord, MemcpyRecord, Note, SyncRecord
from tests.agent_in_process import wait
from tests.unit.test_cuptiraw import LAYOUT, _connect, hdr, kernel, pack_sizes

REPO = Path(__file__).parents[2]


def test_each_vendor_has_both_halves_and_declares_capabilities():
    assert set(vendors.collector_names()) == set(VENDORS) == {"cupti", "rocm"}
    classes = {name: cls for name, cls, _libs in agent_gpu.COLLECTORS}
    for name, v in VENDORS.items():
        assert v.name == name
        assert (REPO / "inject/agent/gpu" / f"{name}.py").is_file()      # collector: agent tree
        assert (REPO / "inject/channel/gpu" / f"{name}.py").is_file()    # decoder: daemon side
        collector = importlib.import_module("stacklens.inject.agent." + v.collector)
        cls = getattr(collector, classes[name])
        assert cls.name == name
        for method in ("start", "poll", "stop", "stats"):
            assert callable(getattr(cls, method)), (name, method)
        decoder = v.decoder
        assert decoder is importlib.import_module(v.decoder_module)
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
    """They run in the target under a synthetic package name: stdlib only, siblings via _agent()
    (every file of the folder: a collector's parts, cupti_*.py, too)."""
    for path in sorted((REPO / "inject/agent/gpu").glob("*.py")):
        name = path.name
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                assert node.level == 0 and not (node.module or "").startswith("stacklens"), (name, node.module)
            elif isinstance(node, ast.Import):
                assert not any(a.name.startswith("stacklens") for a in node.names), name


ROWS = [{"t": "kernel", "n": ["k"], "r": [[0, 10, 20, 0, 7, 1, 1, 1, 1, 1, 1, 1, 0]]},
        {"t": "api", "r": [["runtime", "cudaLaunchKernel", 5, 1, 9, 1, 211]]},
        {"t": "memcpy", "r": [["HtoD", 64, 30, 40, 0, 7, 2]]},
        {"t": "sync", "r": [["stream", 50, 60, 7, 3]]}]


def _spy(monkeypatch, vendor: Vendor) -> list:
    """Every (kind, message) the declared decoder of ``vendor`` is handed."""
    seen = []
    decode = vendor.decoder.decode

    def spy(t, msg, conn):
        seen.append((t, msg if type(msg) is bytes else msg.get("t")))
        return decode(t, msg, conn)
    monkeypatch.setattr(vendor.decoder, "decode", spy)
    return seen


def test_the_server_hands_every_gpu_message_to_the_declared_decoder(tmp_path, monkeypatch):
    """Rows, CUPTI's layout, a raw frame and a buffer read in place all reach
    ``VENDORS["cupti"].decoder.decode``: the records come out of it, nothing bypasses it."""
    import ctypes

    seen = _spy(monkeypatch, VENDORS["cupti"])
    rocm_seen = _spy(monkeypatch, VENDORS["rocm"])
    srv = AgentServer(os.getpid(), tmp_path / "agents")
    try:
        c = _connect(srv)
        data = pack_sizes([kernel(8, 30, 40)])
        buf = ctypes.create_string_buffer(data, len(data))
        raw = wire.encode_raw(hdr(), pack_sizes([kernel(7, 10, 20)]))
        for m in [*ROWS, LAYOUT]:
            c.sendall(wire.encode(m))
        c.sendall(raw)
        c.sendall(wire.encode({"t": "cupti_ref", "h": hdr(), "a": ctypes.addressof(buf), "n": len(data)}))
        c.sendall(wire.encode({"t": "note", "level": "info", "msg": "after", "t_ns": 1}))
        assert wait(lambda: srv.stats().get("records", 0) >= 1 + 4 + 2 + 1)
        recs = srv.poll()[1:]
        c.close()
    finally:
        srv.close()
    assert [type(r) for r in recs] == [KernelRecord, ApiRecord, MemcpyRecord, SyncRecord, KernelRecord, KernelRecord,
                                       Note]
    assert [t for t, _ in seen] == ["kernel", "api", "memcpy", "sync", "cupti_layout", "cupti_raw", "cupti_ref"]
    assert seen[5][1] == raw[4:]                # the raw frame as it came, without its length
    assert rocm_seen == []


def test_a_registered_vendors_decoder_decodes_what_it_declares(tmp_path, monkeypatch):
    """A vendor added to the declaration decodes its kinds without a change to the server; rows
    (which every collector may send) follow the connection's vendor once one of its own kinds
    named it."""
    fake = types.ModuleType("_stacklens_fake_gpu_decoder")
    fake.MESSAGES = ROW_KINDS + ("fake_stats",)
    got = []

    def decode(t, msg, conn):
        got.append(t)
        return [Note("info", f"fake {t}", 0)]
    fake.decode = decode
    monkeypatch.setitem(sys.modules, fake.__name__, fake)
    monkeypatch.setitem(VENDORS, "fake", Vendor("fake", joins=("order",), raw_buffers=False, module=fake.__name__))
    conn = Connection(1)
    assert route("kernel", conn) is VENDORS["cupti"] and conn.vendor is None      # shared, first declared
    assert route("fake_stats", conn) is VENDORS["fake"] and conn.vendor is VENDORS["fake"]
    assert route("kernel", conn) is VENDORS["fake"] and route("note", conn) is None
    srv = AgentServer(os.getpid(), tmp_path / "agents")
    try:
        c = _connect(srv)
        for m in [{"t": "fake_stats"}, *ROWS]:
            c.sendall(wire.encode(m))
        assert wait(lambda: srv.stats().get("records", 0) >= 1 + 5)
        recs = srv.poll()[1:]
        c.close()
    finally:
        srv.close()
    assert got == ["fake_stats", "kernel", "api", "memcpy", "sync"]
    assert [r.message for r in recs] == [f"fake {t}" for t in got]


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
    assert s.join_kind is JoinKind.ORDER and type(s.joiner.gpu_join) is LaunchOrderJoin and "gpu_api_records" not in kw
    s, kw = _session("cupti", True)
    assert type(s.joiner.gpu_join) is ApiRecordJoin and kw["gpu_api_records"] is True
    s, kw = _session("rocm", False)     # ROCm declares the API-record join only
    assert s.join_kind is JoinKind.API_RECORDS and type(s.joiner.gpu_join) is ApiRecordJoin
    assert kw["gpu_api_records"] is True
    # a new vendor's declaration, not its name, decides
    monkeypatch.setitem(VENDORS, "newgpu", Vendor("newgpu", joins=(JoinKind.ORDER,), raw_buffers=False))
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
    for part in ("cupti_raw", "cupti_rows", "cupti_teardown"):   # the collector's parts, from the folder
        mod = sys.modules[f"{m.__name__}.gpu.{part}"]
        assert mod.__file__ == f"{d}/gpu/{part}.py" and mod.__package__ == m.__name__ + ".gpu"
    assert {b.__module__ for b in type(c).__mro__[1:-1]} == {
        m.__name__ + ".gpu." + p for p in ("cupti_raw", "cupti_rows", "cupti_teardown")}
