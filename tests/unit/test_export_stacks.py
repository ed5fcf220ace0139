"""One naming across the stack exports (issue 30): pprof, folded and speedscope name a frame by
one rule (render/stacks.py `frame_name`); folded lines parse as flamegraph.pl reads them; speedscope
has time units where the metric has them and one profile per thread."""

from __future__ import annotations

import gzip
import json
import re
from collections import Counter
from pathlib import Path

import jsonschema
from hypothesis import example, given
from hypothesis import strategies as st

from stacklens.cct import CCT, Frame, Snapshot
from stacklens.cct.frames import python_module_of
from stacklens.render.folded import folded_frame, to_folded
from stacklens.render.pprof import to_pprof
from stacklens.render.speedscope import to_speedscope
from stacklens.render.stacks import FrameName, display_path, frame_name, module_of_path

DATA = Path(__file__).parents[1] / "data" / "schemas" / "speedscope-file-format-schema.json"
PUBLISHED = Path(__file__).parents[2] / ".venv" / "share" / "speedscope" / "file-format-schema.json"
SITE = "/opt/venv/lib/python3.11/site-packages"

KINDS = {
    Frame.python("/srv/app/model.py", "Block.forward", 17):
        FrameName("model.Block.forward", "Block.forward", "model.py", 17),
    Frame.python(f"{SITE}/torch/nn/modules/module.py", "Module._call_impl", 1750):
        FrameName("torch.nn.modules.module.Module._call_impl", "Module._call_impl", "torch/nn/modules/module.py", 1750),
    Frame.python("/usr/lib/python3.11/threading.py", "Thread.run", 982):
        FrameName("threading.Thread.run", "Thread.run", "threading.py", 982),
    Frame.python("<frozen importlib._bootstrap>", "_find_and_load", 1176):
        FrameName("<frozen importlib._bootstrap>._find_and_load", "_find_and_load", "<frozen importlib._bootstrap>", 1176),
    Frame.native("/usr/lib/x86_64-linux-gnu/libc.so.6", "memcpy"): FrameName("memcpy", "memcpy", "libc.so.6", 0),
    Frame.native("libcuda.so.1", "[stripped]"): FrameName("[stripped]", "[stripped]", "libcuda.so.1", 0),
    Frame.op("aten::addmm"): FrameName("aten::addmm", "aten::addmm", "", 0),
    Frame.kernel("ampere_sgemm_128x64_tn"): FrameName("ampere_sgemm_128x64_tn", "ampere_sgemm_128x64_tn", "", 0),
    Frame.api("cuLaunchKernel"): FrameName("cuLaunchKernel", "cuLaunchKernel", "", 0),
    Frame.backward("AddmmBackward0"): FrameName("backward:AddmmBackward0", "backward:AddmmBackward0", "", 0),
    Frame.module("transformer.h.0.attn", "GPT2Attention"):
        FrameName("module:GPT2Attention:transformer.h.0.attn", "module:GPT2Attention:transformer.h.0.attn", "", 0),
    Frame.memcpy("DtoH (Device -> Pinned)"):
        FrameName("memcpy:DtoH (Device -> Pinned)", "memcpy:DtoH (Device -> Pinned)", "", 0),
    Frame.other("[other]"): FrameName("[other]", "[other]", "", 0),
}


def test_a_frame_is_named_by_kind() -> None:
    for frame, name in KINDS.items():
        assert frame_name(frame) == name, frame
    # py-spy's raw format, one frame: `function (file:line)`, `function (file)`, `function`
    assert frame_name(Frame.python("/srv/app/model.py", "Block.forward", 17)).text() == "Block.forward (model.py:17)"
    assert frame_name(Frame.native("/lib/libc.so.6", "read")).text() == "read (libc.so.6)"
    assert frame_name(Frame.op("aten::mm")).text() == "aten::mm"


def test_display_path_is_the_same_on_every_machine() -> None:
    """Relative to site-packages / dist-packages or the standard library, else the file's name,
    as py-spy shows a file outside a package: a venv or a checkout's place does not show."""
    cases = {
        f"{SITE}/torch/nn/modules/linear.py": "torch/nn/modules/linear.py",
        "/home/u/.venv/lib/python3.12/site-packages/torch/nn/modules/linear.py": "torch/nn/modules/linear.py",
        "/usr/lib/python3/dist-packages/numpy/__init__.py": "numpy/__init__.py",
        "/usr/lib/python3.11/concurrent/futures/thread.py": "concurrent/futures/thread.py",
        "/root/.pyenv/versions/3.13.1/lib/python3.13t/threading.py": "threading.py",
        "/opt/conda/lib64/python3.10/json/decoder.py": "json/decoder.py",
        "/srv/job/train.py": "train.py",
        "scripts/train.py": "train.py",
        "train.py": "train.py",
        "<string>": "<string>",
        "<frozen importlib._bootstrap>": "<frozen importlib._bootstrap>",
    }
    assert {f: display_path(f) for f in cases} == cases
    assert module_of_path("concurrent/futures/thread.py") == "concurrent.futures.thread"
    assert module_of_path("numpy/__init__.py") == "numpy" and module_of_path("<string>") == "<string>"
    # where the model view's module rules look (site-packages, scripts), the one module rule
    for f in (f"{SITE}/torch/nn/modules/linear.py", "/usr/lib/python3/dist-packages/numpy/__init__.py",
              "/srv/job/train.py", "<string>"):
        assert module_of_path(display_path(f)) == python_module_of(f), f


def snapshot_of_every_kind() -> Snapshot:
    tree = CCT()
    frames = list(KINDS)
    for i in range(len(frames)):
        tree.add(tuple(frames[: i + 1]), "cpu_samples", i + 1)
    return tree.snapshot(meta={"cpu_hz": 100})


def test_the_three_exports_name_frames_alike() -> None:
    snap = snapshot_of_every_kind()
    folded = to_folded(snap, "cpu_samples", inclusive=True).splitlines()
    deepest = max(folded, key=lambda line: line.count(";")).rpartition(" ")[0]
    assert deepest.split(";") == [frame_name(f).text() for f in KINDS]
    doc = to_speedscope(snap, "cpu_samples")
    assert [f["name"] for f in doc["shared"]["frames"][1:]] == [n.function for n in KINDS.values()]
    assert [(f.get("file", ""), f.get("line", 0)) for f in doc["shared"]["frames"][1:]] == [
        (n.file, n.line) for n in KINDS.values()]
    pprof = gzip.decompress(to_pprof(snap))
    assert all(n.function.encode() in pprof for n in KINDS.values())   # Function.name, the same strings


# flamegraph.pl's reading of a line (stackcollapse output): the value is the last blank-separated
# number, and a number before it makes the line a differential one (two values); frames split at ';'
_LINE = re.compile(r"^(.*)\s+?(\d+(?:\.\d*)?)$")


def flamegraph_pl_reads(line: str) -> tuple[list[str], int] | None:
    m = _LINE.match(line)
    if m is None or _LINE.match(m.group(1)):
        return None
    return m.group(1).split(";"), int(m.group(2))


NASTY = st.text(st.sampled_from("ab ;\n\r\t(:)[]<>%0123456789."), min_size=1, max_size=12)
NASTY_FRAMES = st.one_of(
    st.builds(Frame.python, st.sampled_from(["/srv/x.py", "/tmp/a b;c.py", "<string>"]), NASTY, st.integers(0, 99)),
    st.builds(Frame.native, st.sampled_from(["libc.so.6", "/lib/x;y.so", ""]), NASTY),
    st.builds(Frame.op, NASTY), st.builds(Frame.kernel, NASTY), st.builds(Frame.other, NASTY),
)


@given(st.lists(st.tuples(st.lists(NASTY_FRAMES, min_size=1, max_size=4).map(tuple), st.integers(1, 10**6)),
                min_size=1, max_size=8))
@example([((Frame.op(" 0."),), 1)])     # "0." reads as a number: found by a CI run (2026-12-05)
def test_folded_lines_parse_as_flamegraph_pl_reads_them(paths) -> None:
    """No registry this project installs from ships flamegraph.pl: each line is checked against its
    reading of a line (stackcollapse format), `frame;frame
    COUNT`: one value, as many frames as the path, none with a ';' or a line break in it."""
    tree = CCT()
    for path, value in paths:
        tree.add(path, "cpu_samples", value)
    snap = tree.snapshot()
    expected: Counter = Counter()   # frames of two kinds may read alike (op and kernel `x`): added up, as flamegraph.pl does
    for path, values in snap.iter_paths():
        expected[";".join(folded_frame(f) for f in path)] += values["cpu_samples"]
    text = to_folded(snap, "cpu_samples")
    assert text.endswith("\n") and "\r" not in text
    got: Counter = Counter()
    for line in text.splitlines():
        read = flamegraph_pl_reads(line)
        assert read is not None, line
        frames, value = read
        assert all(f and ";" not in f and "\n" not in f for f in frames), line
        got[";".join(frames)] += value
    assert got == expected
    assert sum(got.values()) == snap.total("cpu_samples")


def threaded() -> Snapshot:
    main = (Frame.python("/srv/app/main.py", "main", 20),)
    prep, enc = main + (Frame.python("/srv/app/prep.py", "preprocess", 5),), main + (
        Frame.python("/srv/app/model.py", "encoder", 11),)
    tree = CCT(("gpu_time_ns", "cpu_samples", "py_samples"))
    tree.add_sample(prep, "cpu_samples", 41, 30)
    tree.add_sample(enc, "cpu_samples", 42, 50)
    tree.add_sample(enc, "cpu_samples", 43, 3)
    tree.add_sample(enc, "cpu_samples", 0, 2)          # no thread known: [other threads]
    tree.add_sample(prep, "py_samples", 41, 7)
    tree.add(enc, "gpu_time_ns", 5_000)
    meta = {"pid": 4242, "name": "train", "cpu_hz": 100, "threads": {"41": "loader", "42": "trainer"}}
    return tree.snapshot(meta=meta)


def schemas() -> list[dict]:
    found = [json.loads(DATA.read_text())]
    if PUBLISHED.exists():   # speedscope's own (scripts/setup.sh fetches it from its npm package)
        found.append(json.loads(PUBLISHED.read_text()))
    return found


def test_speedscope_has_a_profile_per_thread() -> None:
    snap = threaded()
    doc = to_speedscope(snap, "cpu_samples")
    for schema in schemas():
        jsonschema.validate(doc, schema)
    profiles = doc["profiles"]
    assert [p["name"] for p in profiles] == [
        "train cpu_samples · all threads", "train cpu_samples · trainer (tid 42)",
        "train cpu_samples · loader (tid 41)", "train cpu_samples · tid 43", "train cpu_samples · [other threads]"]
    assert doc["activeProfileIndex"] == 0   # opens on the whole process
    period = 10_000_000   # 100 Hz: a sample is 10 ms of CPU, as pprof's cpu/nanoseconds
    assert all(p["unit"] == "nanoseconds" and p["endValue"] == sum(p["weights"]) for p in profiles)
    assert [p["endValue"] // period for p in profiles] == [85, 50, 30, 3, 2]
    names = [f["name"] for f in doc["shared"]["frames"]]
    assert [[names[i] for i in s] for s in profiles[2]["samples"]] == [["main.main", "prep.preprocess"]]


def test_speedscope_samples_run_depth_first() -> None:
    """A context's samples follow one another, whatever order the contexts were first seen in:
    speedscope's time-order view draws each once."""
    a, b, c, d = (Frame.op(n) for n in "abcd")
    tree = CCT()
    for path in ((a, b), (c,), (a, d), (a,), (c, b)):
        tree.add(path, "cpu_samples", 1)
    doc = to_speedscope(tree.snapshot(), "cpu_samples")
    names = [f["name"] for f in doc["shared"]["frames"]]
    assert [[names[i] for i in s] for s in doc["profiles"][0]["samples"]] == [
        ["a"], ["a", "b"], ["a", "d"], ["c"], ["c", "b"]]


def test_speedscope_units() -> None:
    snap = threaded()
    units = {m: [p["unit"] for p in to_speedscope(snap, m)["profiles"]] for m in ("cpu_samples", "gpu_time_ns", "py_samples")}
    assert units == {"cpu_samples": ["nanoseconds"] * 5, "gpu_time_ns": ["nanoseconds"],   # one profile: no thread breakdown
                     "py_samples": ["none", "none"]}                                   # a count at no known rate
    unknown_rate = Snapshot(snap.metrics, [snap.frame_of(n) for n in range(snap.node_count)],
                            [snap.parent(n) for n in range(snap.node_count)],
                            {m: snap.exclusive_column(m) for m in snap.metrics}, meta={"cpu_hz": 0})
    profile = to_speedscope(unknown_rate, "cpu_samples")["profiles"][0]
    assert profile["unit"] == "none" and profile["endValue"] == 85
    for schema in schemas():
        for metric in ("gpu_time_ns", "py_samples"):
            jsonschema.validate(to_speedscope(snap, metric), schema)
