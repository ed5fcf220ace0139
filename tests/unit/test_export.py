"""Folded, speedscope and JSON exports; save / load and their error messages."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import jsonschema
import pytest
from hypothesis import given
from hypothesis import strategies as st

from stacklens.cct import CCT, Frame, Snapshot
from stacklens.cct.export import from_json, load, save, to_json
from stacklens.render.folded import to_folded
from stacklens.render.speedscope import to_speedscope
from stacklens.errors import InputError

SCHEMAS = Path(__file__).parents[1] / "data" / "schemas"

MAIN = Frame.python("/srv/train.py", "main", 12)
STEP = Frame.python("/srv/train.py", "step", 40)
MM = Frame.op("aten::addmm")
LAUNCH = Frame.native("libcudart.so.12", "cudaLaunchKernel")
GEMM = Frame.kernel("ampere_sgemm_128x64_tn")
ODD = Frame.native("lib;semi.so", "f\nnewline")


def sample() -> Snapshot:
    tree = CCT()
    tree.add((MAIN, STEP, MM, LAUNCH, GEMM), "gpu_time_ns", 120_000)
    tree.add((MAIN, STEP, MM, LAUNCH), "api_cpu_ns", 9_000)
    tree.add_many((MAIN, STEP, MM, LAUNCH), {"launch_count": 3})
    tree.add((MAIN, STEP), "cpu_samples", 5)
    tree.add((MAIN, ODD), "cpu_samples", 1)
    tree.add((MAIN,), "alloc_bytes", 4096)
    return tree.snapshot(meta={"pid": 4242, "name": "train"}, unavailable={"copy_bytes"})


def test_folded() -> None:
    """Frames named as py-spy names them (`function (file:line)`, native `symbol (library)`), the
    rule pprof and speedscope name them by (tests/unit/test_export_stacks.py)."""
    snap = sample()
    assert to_folded(snap, "cpu_samples") == (
        "main (train.py:12);f%0Anewline (lib%3Bsemi.so) 1\n"
        "main (train.py:12);step (train.py:40) 5\n"
    )
    assert to_folded(snap, "gpu_time_ns") == (
        "main (train.py:12);step (train.py:40);aten::addmm;"
        "cudaLaunchKernel (libcudart.so.12);ampere_sgemm_128x64_tn 120000\n"
    )
    inclusive = to_folded(snap, "api_cpu_ns", inclusive=True).splitlines()
    assert inclusive[0] == "main (train.py:12) 9000" and len(inclusive) == 4
    assert to_folded(snap, "sync_wait_ns") == ""


def test_folded_root_values_and_refusals() -> None:
    tree = CCT()
    tree.add((), "cpu_samples", 2)
    assert to_folded(tree.snapshot(), "cpu_samples") == "[root] 2\n"
    with pytest.raises(InputError, match="not measured.*choose one of"):
        to_folded(sample(), "copy_bytes")
    with pytest.raises(InputError, match="unknown metric"):
        to_folded(sample(), "nope")


PUBLISHED_SPEEDSCOPE = Path(__file__).parents[2] / ".venv" / "share" / "speedscope" / "file-format-schema.json"


def test_speedscope_validates_against_speedscope_published_schema() -> None:
    """The schema shipped in speedscope's npm package (fetched by scripts/setup.sh)."""
    if not PUBLISHED_SPEEDSCOPE.exists():
        pytest.skip("speedscope's schema not fetched (npm unavailable when scripts/setup.sh ran)")
    schema = json.loads(PUBLISHED_SPEEDSCOPE.read_text())
    snap = sample()
    for metric in ("gpu_time_ns", "cpu_samples", "alloc_bytes", "sync_wait_ns"):
        jsonschema.validate(to_speedscope(snap, metric), schema)


def test_speedscope_validates_against_the_schema() -> None:
    schema = json.loads((SCHEMAS / "speedscope-file-format-schema.json").read_text())
    snap = sample()
    for metric in ("gpu_time_ns", "cpu_samples", "alloc_bytes", "sync_wait_ns"):
        doc = to_speedscope(snap, metric)
        jsonschema.validate(doc, schema)
        json.dumps(doc)
        profile = doc["profiles"][0]
        assert sum(profile["weights"]) == snap.total(metric) == profile["endValue"]
    doc = to_speedscope(snap, "gpu_time_ns")
    frames = doc["shared"]["frames"]
    (stack,) = doc["profiles"][0]["samples"]
    assert [frames[i] for i in stack] == [
        {"name": "train.main", "file": "train.py", "line": 12},
        {"name": "train.step", "file": "train.py", "line": 40},
        {"name": "aten::addmm"},
        {"name": "cudaLaunchKernel", "file": "libcudart.so.12"},
        {"name": "ampere_sgemm_128x64_tn"},
    ]
    assert doc["profiles"][0]["unit"] == "nanoseconds"
    assert to_speedscope(snap, "cpu_samples")["profiles"][0]["unit"] == "none"   # no sampling rate known
    assert to_speedscope(snap, "alloc_bytes")["profiles"][0]["unit"] == "bytes"
    assert to_speedscope(snap, "launch_count")["profiles"][0]["unit"] == "none"
    with pytest.raises(InputError):
        to_speedscope(snap, "copy_bytes")


FRAMES = (MAIN, STEP, MM, LAUNCH, GEMM, ODD, Frame.other("[truncated]"), Frame.instruction("HMMA"))
events = st.lists(
    st.tuples(
        st.lists(st.sampled_from(FRAMES), max_size=5).map(tuple),
        st.sampled_from(("gpu_time_ns", "cpu_samples", "alloc_bytes")),
        st.integers(-(2**40), 2**62),
    ),
    max_size=30,
)


@given(events, st.integers(0, 50), st.booleans())
def test_json_round_trip(evs, folded, with_meta) -> None:
    tree = CCT(max_nodes=None)
    for path, metric, value in evs:
        tree.add(path, metric, value)
    tree._folded = folded
    snap = tree.snapshot(meta={"pid": 1, "argv": ["a", "b"]} if with_meta else None, unavailable={"sync_wait_ns"})
    obj = to_json(snap)
    back = from_json(json.loads(json.dumps(obj)))
    assert back == snap
    assert to_json(back) == obj


def test_json_form_is_documented_shape() -> None:
    obj = to_json(sample())
    assert obj["format"] == "stacklens.profile" and obj["version"] == 1
    assert obj["nodes"][0] == [-1, -1, {}]
    assert obj["frames"][0] == ["python", "main", "/srv/train.py", 12]
    assert obj["unavailable"] == ["copy_bytes"] and obj["meta"] == {"pid": 4242, "name": "train"}


@pytest.mark.parametrize("name", ["p.json", "p.json.gz"])
def test_save_and_load(tmp_path: Path, name: str) -> None:
    snap = sample()
    path = tmp_path / name
    save(snap, path)
    assert (path.read_bytes()[:2] == b"\x1f\x8b") == name.endswith(".gz")
    assert load(path) == snap
    assert [p.name for p in tmp_path.iterdir()] == [name]  # no temporary file left behind


def test_save_refuses_unknown_format(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="json.gz"):
        save(sample(), tmp_path / "p.svg", fmt="svg")


def write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


def corrupt_cases(tmp: Path) -> list[tuple[Path, str]]:
    good = json.dumps(to_json(sample())).encode()
    gz = gzip.compress(good)
    flipped = bytearray(gz)
    flipped[len(flipped) // 2] ^= 0xFF
    newer = dict(to_json(sample()), version=99)
    orphan = to_json(sample())
    orphan["nodes"][2][0] = 7
    return [
        (tmp / "missing.json", "no such file"),
        (write(tmp / "empty.json", b""), "empty"),
        (write(tmp / "cut.json", good[: len(good) // 2]), "not valid JSON.*truncated"),
        (write(tmp / "cut.json.gz", gz[: len(gz) // 2]), "truncated or corrupt gzip"),
        (write(tmp / "flipped.json.gz", bytes(flipped)), "truncated or corrupt gzip|not valid JSON|binary"),
        (write(tmp / "binary.pb", bytes(range(256))), "binary data"),
        (write(tmp / "list.json", b"[1, 2]"), "not a valid stacklens profile"),
        (write(tmp / "newer.json", json.dumps(newer).encode()), "newer than this stacklens.*upgrade"),
        (write(tmp / "orphan.json", json.dumps(orphan).encode()), "parents must come before"),
        (tmp, "cannot read it"),
    ]


def test_load_errors_say_what_is_wrong(tmp_path: Path) -> None:
    for path, message in corrupt_cases(tmp_path):
        with pytest.raises(InputError, match=message) as info:
            load(path)
        assert str(path) in str(info.value)
        assert "pass a profile written by stacklens" in str(info.value) or "upgrade stacklens" in str(info.value)


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda o: o.update(metrics=[]), "metrics"),
        (lambda o: o.update(metrics=["a", "a"]), "duplicates"),
        (lambda o: o.update(unavailable=["nope"]), "unavailable"),
        (lambda o: o.update(folded_nodes="3"), "folded_nodes"),
        (lambda o: o["frames"].append(["alien", "x", "", 0]), "kind one of"),
        (lambda o: o["nodes"].__setitem__(0, [0, 0, {}]), "root"),
        (lambda o: o["nodes"][1].__setitem__(1, 999), "not in \"frames\""),
        (lambda o: o["nodes"][1][2].update(gpu_time_ns=1.5), "integers"),
        (lambda o: o["nodes"].append(list(o["nodes"][1])), "repeats"),
        (lambda o: o.update(version="1"), "unsupported version"),
        (lambda o: o.update(frames=3), "\"frames\" must be a list"),
        (lambda o: o.update(nodes={}), "\"nodes\" must be"),
    ],
)
def test_from_json_rejects(mutate, message) -> None:
    obj = to_json(sample())
    mutate(obj)
    with pytest.raises(InputError, match=message):
        from_json(obj)


def test_documented_example_loads() -> None:
    doc = (Path(__file__).parents[2] / "docs" / "profile-format.md").read_text()
    example = doc.split("```json\n", 1)[1].split("```", 1)[0]
    snap = from_json(json.loads(example))
    node = snap.find(["py:/srv/train.py:step:40", "op:aten::addmm", "kernel:ampere_sgemm_128x64_tn"])
    assert node is not None and snap.exclusive(node, "gpu_time_ns") == 120_000
    assert snap.total("api_cpu_ns") == 9000 and snap.unavailable == {"copy_bytes"}
    assert to_json(snap) == json.loads(example)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-3, 3) | st.floats(allow_nan=False) | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=20,
)


@given(st.sampled_from(["metrics", "unavailable", "folded_nodes", "meta", "frames", "nodes"]), json_values)
def test_from_json_fails_only_with_input_error(key, value) -> None:
    obj = to_json(sample())
    obj[key] = value
    try:
        snap = from_json(obj)
    except InputError:
        return
    assert isinstance(snap, Snapshot)
