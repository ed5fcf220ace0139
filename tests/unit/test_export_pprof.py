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
from stacklens.render.pprof import to_pprof
from stacklens.render.stacks import frame_name, unit_of
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


def metric_of(sample_type: str) -> str:
    """The tree metric a pprof sample type carries (CPU samples are pprof's `samples`)."""
    return "cpu_samples" if sample_type == "samples" else sample_type


def type_names(snap: Snapshot) -> list[str]:
    return ["samples" if m == "cpu_samples" else m for m in snap.metrics if m not in snap.unavailable]


def parsed_totals(profile) -> tuple[dict, dict]:
    """({metric: total}, {(path labels, outermost first): {metric: value}}) of a parsed Profile."""
    strings = list(profile.string_table)
    names = [metric_of(strings[t.type]) for t in profile.sample_type]
    function_name = {f.id: strings[f.system_name] for f in profile.function}   # the frame's label
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
    assert types == [(n, unit_of(metric_of(n))) for n in type_names(snap)]
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
    assert types == type_names(snap)
    assert "gpu_time_ns/nanoseconds[dflt]" in header and "alloc_bytes/bytes" in header

    totals: Counter = Counter()
    for line in raw.split("Samples:\n", 1)[1].split("Locations", 1)[0].splitlines()[1:]:
        m = re.match(r"^\s*([-\d\s]+):", line)
        if m:
            for name, value in zip(types, m.group(1).split()):
                totals[metric_of(name)] += int(value)
    assert dict(totals) == {metric_of(n): snap.total(metric_of(n)) for n in types}
    locations = raw.split("Locations\n", 1)[1]
    for frame in FRAMES:
        assert frame_name(frame).function in locations


def _go_pprof(tmp_path: Path, *args: str) -> str:
    go = shutil.which("go") or ("/usr/bin/go" if Path("/usr/bin/go").exists() else None)
    if go is None:
        pytest.skip("Go is not installed (Debian: apt-get install golang-go); `go tool pprof` unavailable")
    r = subprocess.run([go, "tool", "pprof", *args], capture_output=True, text=True, timeout=120,
                       env={"HOME": str(tmp_path), "PATH": "/usr/bin:/bin", "GOCACHE": str(tmp_path / "gocache")})
    assert r.returncode == 0, r.stderr
    return r.stdout


def test_pprof_reads_it_by_its_conventions(tmp_path: Path) -> None:
    """Functions once each, by module (two `forward`s stay apart), their lines with `-lines`,
    CPU as samples/count and cpu/nanoseconds at the sampling period (`-unit=ms`), the profile's
    time and duration; GPU time is the default where it was measured."""
    main = (Frame.python("/srv/app/main.py", "<module>", 30), Frame.python("/srv/app/main.py", "main", 20))
    tree = CCT()
    tree.add(main + (Frame.python("/srv/app/prep.py", "preprocess", 5),), "cpu_samples", 30)
    tree.add(main + (Frame.python("/srv/app/prep.py", "preprocess", 7),), "cpu_samples", 20)
    tree.add(main + (Frame.python("/srv/app/model.py", "encoder", 11),), "cpu_samples", 40)
    tree.add(main + (Frame.python("/srv/app/model.py", "forward", 50),), "cpu_samples", 4)
    tree.add(main + (Frame.python("/srv/app/head.py", "forward", 9),), "cpu_samples", 6)
    meta = {"cpu_hz": 100, "start_unix_ns": 1_700_000_000_000_000_000, "window": {"seconds": 2.0}}
    path = tmp_path / "cpu.pb.gz"
    path.write_bytes(to_pprof(tree.snapshot(meta=meta, unavailable={"gpu_time_ns"})))
    top = _go_pprof(tmp_path, "-top", "-unit=ms", str(path))
    assert "Type: cpu" in top and "Duration: 2s" in top and "Total samples = 1000ms" in top, top
    rows = [ln.split() for ln in top.splitlines() if re.match(r"^\s+\d+ms", ln)]
    assert [(r[0], r[-1]) for r in rows] == [("500ms", "prep.preprocess"), ("400ms", "model.encoder"),
                                             ("60ms", "head.forward"), ("40ms", "model.forward")], top
    lines = _go_pprof(tmp_path, "-top", "-lines", "-sample_index=samples", str(path))
    assert re.search(r"\b30\b.*prep\.preprocess /srv/app/prep\.py:5", lines), lines
    assert re.search(r"\b20\b.*prep\.preprocess /srv/app/prep\.py:7", lines), lines

    tree.add(main + (Frame.op("aten::mm"), Frame.kernel("gemm")), "gpu_time_ns", 7_000)
    path.write_bytes(to_pprof(tree.snapshot(meta=meta)))
    assert "Type: gpu_time_ns" in _go_pprof(tmp_path, "-top", str(path))


def test_the_python_module_of_a_file() -> None:
    from stacklens.cct.frames import python_module_of

    assert python_module_of("/usr/lib/python3/dist-packages/torch/nn/modules/linear.py") == "torch.nn.modules.linear"
    assert python_module_of("/v/lib/python3.11/site-packages/transformers/__init__.py") == "transformers"
    assert python_module_of("/srv/app/prep.py") == "prep" and python_module_of("<string>") == "<string>"


def threaded() -> Snapshot:
    main = (Frame.python("/srv/app/main.py", "main", 20),)
    tree = CCT()
    tree.add_sample(main + (Frame.python("/srv/app/prep.py", "preprocess", 5),), "cpu_samples", 41, 30)
    tree.add_sample(main + (Frame.python("/srv/app/model.py", "encoder", 11),), "cpu_samples", 42, 50)
    tree.add_sample(main + (Frame.python("/srv/app/model.py", "encoder", 11),), "cpu_samples", 43, 3)
    tree.add_sample(main + (Frame.python("/srv/app/model.py", "encoder", 11),), "cpu_samples", 0, 2)
    tree.add(main + (Frame.python("/srv/app/model.py", "encoder", 11),), "gpu_time_ns", 5_000)
    meta = {"pid": 4242, "cpu_hz": 100, "threads": {"41": "loader", "42": "trainer"}}
    return tree.snapshot(meta=meta)


def test_samples_carry_pid_and_thread_labels(profile_pb2) -> None:
    snap = threaded()
    profile = profile_pb2.Profile()
    profile.ParseFromString(gzip.decompress(to_pprof(snap)))
    strings = list(profile.string_table)
    assert parsed_totals(profile)[0] == {"cpu_samples": 85, "cpu": 85 * 10_000_000, "gpu_time_ns": 5_000}
    seen = set()
    for sample_ in profile.sample:
        labels = {strings[lb.key]: strings[lb.str] if lb.str else lb.num for lb in sample_.label}
        assert labels.pop("pid") == 4242
        seen.add(tuple(sorted(labels.items())))
    # one sample per (node, thread); the unnamed thread by tid, the unknown one as [other threads];
    # GPU time is not counted by thread
    assert seen == {(("thread", "loader"), ("tid", 41)), (("thread", "trainer"), ("tid", 42)), (("tid", 43),),
                    (("thread", "[other threads]"),), ()}


def test_go_tool_pprof_focuses_on_a_thread(tmp_path: Path) -> None:
    path = tmp_path / "threads.pb.gz"
    path.write_bytes(to_pprof(threaded()))

    def top(*args: str) -> list[tuple[str, str]]:
        out = _go_pprof(tmp_path, "-top", "-sample_index=samples", *args, str(path))
        return [(r[0], r[-1]) for r in (ln.split() for ln in out.splitlines()) if r and r[0].isdigit() and r[0] != "0"]   # flat > 0

    assert top("-tagfocus=thread=loader") == [("30", "prep.preprocess")]
    assert top("-tagfocus=thread=trainer") == [("50", "model.encoder")]
    assert top("-tagfocus=tid=43") == [("3", "model.encoder")]
    assert top("-tagfocus=thread=other threads") == [("2", "model.encoder")]
    assert top() == [("55", "model.encoder"), ("30", "prep.preprocess")]    # every thread, all of it
