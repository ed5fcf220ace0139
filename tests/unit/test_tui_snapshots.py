"""SVG snapshot tests of `stacklens top` (pytest-textual-snapshot; Textual pinned in pyproject).

Baselines live in tests/unit/__snapshots__/test_tui_snapshots/; after an intended change of the
look, regenerate them with `pytest tests/unit/test_tui_snapshots.py --snapshot-update` and review
the SVGs before committing.
"""

from __future__ import annotations

import pytest

from stacklens.cct import CCT, METRICS
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
    app = profile_app(sample_snapshot(gpu=False))
    assert snap_compare(app, terminal_size=size, run_before=keys_then_settle("M", "M", "M", "M", "M"))


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
