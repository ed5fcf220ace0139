"""pprof export, read back two independent ways: protobuf parsing with the profile.proto schema
compiled by protoc, and Go's pprof reader (`go tool pprof -raw`)."""

from __future__ import annotations

import gzip
import importlib.util
import re
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path
from types import ModuleType

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stacklens.cct import CCT, Frame, Snapshot
from stacklens.cct.export import to_pprof, unit_of
from stacklens.errors import InputError

SCHEMA = Path(__file__).parents[1] / "data" / "schemas" / "profile.proto"


@pytest.fixture(scope="module")
def profile_pb2(tmp_path_factory) -> ModuleType:
    pytest.importorskip("grpc_tools")
    out = tmp_path_factory.mktemp("pb")
    subprocess.run(
        [sys.executable, "-m", "grpc_tools.protoc", f"-I{SCHEMA.parent}", f"--python_out={out}", SCHEMA.name],
        check=True,
    )
    spec = importlib.util.spec_from_file_location("profile_pb2", out / "profile_pb2.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


FRAMES = (
    Frame.python("/srv/train.py", "step", 40),
    Frame.op("aten::addmm"),
    Frame.native("libtorch_cuda.so", "at::native::(anonymous namespace)::addmm_out_cuda_impl"),
    Frame.api("cuLaunchKernel"),
    Frame.kernel("ampere_sgemm_128x64_tn"),
    Frame.other("[truncated]"),
)


def sample() -> Snapshot:
    tree = CCT()
    tree.add(FRAMES[:5], "gpu_time_ns", 120_000)
    tree.add_many(FRAMES[:4], {"launch_count": 3, "api_cpu_ns": 9_000})
    tree.add(FRAMES[:1], "cpu_samples", 5)
    tree.add(FRAMES[:2] + FRAMES[5:], "alloc_bytes", 1 << 33)
    tree.add((), "sync_wait_ns", 77)
    tree.add(FRAMES[:2], "kernel_count", -4)  # diffs are signed
    return tree.snapshot(unavailable={"copy_bytes"})


def parsed_totals(profile) -> tuple[dict, dict]:
    """({metric: total}, {(path labels, outermost first): {metric: value}}) of a parsed Profile."""
    strings = list(profile.string_table)
    names = [strings[t.type] for t in profile.sample_type]
    function_name = {f.id: strings[f.name] for f in profile.function}
    location_name = {loc.id: function_name[loc.line[0].function_id] for loc in profile.location}
    totals: Counter = Counter()
    paths: dict = {}
    for sample in profile.sample:
        labels = tuple(location_name[i] for i in reversed(sample.location_id))
        paths[labels] = {n: v for n, v in zip(names, sample.value) if v}
        for name, value in zip(names, sample.value):
            totals[name] += value
    return {n: v for n, v in totals.items() if v}, paths


def expected(snap: Snapshot) -> tuple[dict, dict]:
    measured = [m for m in snap.metrics if m not in snap.unavailable]
    paths = {}
    for path, values in snap.iter_paths():
        labels = tuple(f.label() for f in path) or ("[root]",)
        paths[labels] = {m: values[m] for m in measured if values[m]}
    return {m: snap.total(m) for m in measured if snap.total(m)}, paths


def test_parses_with_the_schema(profile_pb2) -> None:
    snap = sample()
    profile = profile_pb2.Profile()
    profile.ParseFromString(gzip.decompress(to_pprof(snap)))
    strings = list(profile.string_table)
    assert strings[0] == ""
    types = [(strings[t.type], strings[t.unit]) for t in profile.sample_type]
    assert types == [(m, unit_of(m)) for m in snap.metrics if m != "copy_bytes"]
    assert ("gpu_time_ns", "nanoseconds") in types and ("alloc_bytes", "bytes") in types
    assert ("launch_count", "count") in types
    assert strings[profile.default_sample_type] == "gpu_time_ns"
    assert any("copy_bytes" in strings[c] for c in profile.comment)
    assert len(profile.function) == len(profile.location) == len({f.label() for f in FRAMES}) + 1  # + [root]
    for sample_ in profile.sample:
        assert len(sample_.value) == len(types)
    assert parsed_totals(profile) == expected(snap)


paths = st.lists(st.sampled_from(FRAMES), max_size=5).map(tuple)
events = st.lists(
    st.tuples(paths, st.sampled_from(("gpu_time_ns", "cpu_samples", "alloc_bytes")), st.integers(-(2**56), 2**56)),
    max_size=30,
)


@settings(suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(events)
def test_round_trips_any_tree(profile_pb2, evs) -> None:
    tree = CCT(max_nodes=None)
    for path, metric, value in evs:
        tree.add(path, metric, value)
    snap = tree.snapshot()
    profile = profile_pb2.Profile()
    profile.ParseFromString(gzip.decompress(to_pprof(snap)))
    assert parsed_totals(profile) == expected(snap)


def test_values_beyond_int64_are_refused() -> None:
    tree = CCT()
    tree.add(FRAMES[:1], "gpu_time_ns", 2**63)
    with pytest.raises(InputError, match="64-bit"):
        to_pprof(tree.snapshot())


def test_go_tool_pprof_reads_it(tmp_path: Path) -> None:
    go = shutil.which("go") or ("/usr/bin/go" if Path("/usr/bin/go").exists() else None)
    if go is None:
        pytest.skip("Go is not installed (Debian: apt-get install golang-go); `go tool pprof` unavailable")
    snap = sample()
    path = tmp_path / "profile.pb.gz"
    path.write_bytes(to_pprof(snap))
    result = subprocess.run(
        [go, "tool", "pprof", "-raw", str(path)],
        capture_output=True,
        text=True,
        timeout=120,
        env={"HOME": str(tmp_path), "PATH": "/usr/bin:/bin", "GOCACHE": str(tmp_path / "gocache")},
    )
    assert result.returncode == 0, result.stderr
    raw = result.stdout
    header = raw.split("Samples:\n", 1)[1].splitlines()[0]
    types = [t.split("/")[0] for t in header.split()]
    assert types == [m for m in snap.metrics if m not in snap.unavailable]
    assert "gpu_time_ns/nanoseconds[dflt]" in header and "alloc_bytes/bytes" in header

    totals: Counter = Counter()
    for line in raw.split("Samples:\n", 1)[1].split("Locations", 1)[0].splitlines()[1:]:
        m = re.match(r"^\s*([-\d\s]+):", line)
        if m:
            for name, value in zip(types, m.group(1).split()):
                totals[name] += int(value)
    assert dict(totals) == {m: snap.total(m) for m in types}
    locations = raw.split("Locations\n", 1)[1]
    for frame in FRAMES:
        assert frame.label() in locations
