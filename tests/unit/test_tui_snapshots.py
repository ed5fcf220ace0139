"""SVG snapshot tests of `stacklens top` (pytest-textual-snapshot; Textual pinned in pyproject).

Baselines live in tests/unit/__snapshots__/test_tui_snapshots/; after an intended change of the
look, regenerate them with `pytest tests/unit/test_tui_snapshots.py --snapshot-update` and review
the SVGs before committing.
"""

from __future__ import annotations

import pytest

from stacklens.cct import CCT, METRICS, Frame, diff
from stacklens.tui.app import StacklensApp
from stacklens.tui.testing import FakeProcesses, FakeSource, gpt2_snapshot, sample_snapshot

SIZES = [pytest.param((80, 24), id="80x24"), pytest.param((160, 50), id="160x50")]


def keys_then_settle(*keys: str):
    async def run_before(pilot) -> None:
        app = pilot.app
        for _ in range(3):
            await pilot.pause()
            await app.workers.wait_for_complete()
        for key in keys:
            await pilot.press(key)
        for _ in range(3):
            await pilot.pause()
            await app.workers.wait_for_complete()

    return run_before


def profile_app(snapshot=None, **kw) -> StacklensApp:
    # live=False: no refresh timer, so nothing changes while the screenshot is taken
    return StacklensApp(source=FakeSource(snapshot or sample_snapshot(), live=False, **kw))


@pytest.mark.parametrize("size", SIZES)
def test_tree(snap_compare, size):
    assert snap_compare(profile_app(), terminal_size=size, run_before=keys_then_settle())


@pytest.mark.parametrize("size", SIZES)
def test_tree_cpu_samples_cursor_moved(snap_compare, size):
    keys = ("m",) * 5 + ("down", "down")
    assert snap_compare(profile_app(), terminal_size=size, run_before=keys_then_settle(*keys))


@pytest.mark.parametrize("size", SIZES)
def test_model_view_gpu(snap_compare, size):
    # a GPU training step (synthetic): opens on GPU time, modules named, no wrapper frames
    assert snap_compare(profile_app(gpt2_snapshot()), terminal_size=size, run_before=keys_then_settle())


def test_model_view_toggled_to_full(snap_compare):
    app = profile_app(gpt2_snapshot())
    assert snap_compare(app, terminal_size=(160, 50), run_before=keys_then_settle("v"))


@pytest.mark.parametrize("size", SIZES)
def test_flame(snap_compare, size):
    assert snap_compare(profile_app(), terminal_size=size, run_before=keys_then_settle("f", "down", "down", "down", "down"))


@pytest.mark.parametrize("size", SIZES)
def test_hotspots(snap_compare, size):
    assert snap_compare(profile_app(), terminal_size=size, run_before=keys_then_settle("h"))


@pytest.mark.parametrize("size", SIZES)
def test_advice(snap_compare, size):
    assert snap_compare(profile_app(), terminal_size=size, run_before=keys_then_settle("a"))


@pytest.mark.parametrize("size", SIZES)
def test_gpu_time_unavailable(snap_compare, size):
    # opens on CPU time; the status line names what was not measured (m never goes there)
    app = profile_app(sample_snapshot(gpu=False))
    assert snap_compare(app, terminal_size=size, run_before=keys_then_settle())


@pytest.mark.parametrize("size", SIZES)
def test_empty_profile(snap_compare, size):
    app = profile_app(CCT(METRICS, max_nodes=None).snapshot())
    assert snap_compare(app, terminal_size=size, run_before=keys_then_settle())


@pytest.mark.parametrize("size", SIZES)
def test_process_list(snap_compare, size):
    assert snap_compare(StacklensApp(processes=FakeProcesses()), terminal_size=size, run_before=keys_then_settle())


@pytest.mark.parametrize("size", SIZES)
def test_process_list_daemon_down(snap_compare, size):
    procs = FakeProcesses()
    procs.down = True
    assert snap_compare(StacklensApp(processes=procs), terminal_size=size, run_before=keys_then_settle())


@pytest.mark.parametrize("size", SIZES)
def test_help(snap_compare, size):
    assert snap_compare(profile_app(), terminal_size=size, run_before=keys_then_settle("question_mark"))


def test_diff_signed_shares(snap_compare):
    before = CCT(METRICS, max_nodes=None)
    recent = CCT(METRICS, max_nodes=None)
    step = Frame.python("/srv/job/train.py", "train_step", 42)
    for tree, gemm, relu in ((recent, 9_000_000, 4_000_000), (before, 5_000_000, 6_000_000)):
        tree.add_many((step, Frame.op("aten::linear"), Frame.kernel("gemm")), {"gpu_time_ns": gemm, "cpu_samples": 9})
        tree.add_many((step, Frame.op("aten::relu"), Frame.kernel("elementwise")), {"gpu_time_ns": relu, "cpu_samples": 3})
    delta = diff(recent.snapshot(meta={"cpu_hz": 99}), before.snapshot(meta={"cpu_hz": 99}))
    app = StacklensApp(source=FakeSource(lambda window_s, is_diff: delta if is_diff else sample_snapshot(), live=False))
    assert snap_compare(app, terminal_size=(160, 30), run_before=keys_then_settle("d", "h"))


SOURCE_FILE = "/tmp/stacklens-snapshot-train.py"  # a fixed path: it is on screen


def test_source_per_line_values(snap_compare):
    with open(SOURCE_FILE, "w") as fh:
        fh.write("".join(f"def step_{i}():\n    return {i}\n" for i in range(1, 31)))
    t = CCT(METRICS, max_nodes=None)
    main = Frame.python(SOURCE_FILE, "main", 3)
    t.add_many((main, Frame.python(SOURCE_FILE, "step_4", 8), Frame.op("aten::mm")), {"cpu_samples": 198})
    t.add_many((main, Frame.python(SOURCE_FILE, "step_6", 12)), {"cpu_samples": 99})
    app = profile_app(t.snapshot(meta={"cpu_hz": 99}))
    assert snap_compare(app, terminal_size=(120, 30), run_before=keys_then_settle("down", "o"))


def test_process_list_cpu_percent(snap_compare):
    # the second reading ("r") gives each process's CPU% from its CPU time (FakeProcesses' clock)
    assert snap_compare(StacklensApp(processes=FakeProcesses()), terminal_size=(120, 24), run_before=keys_then_settle("r"))
