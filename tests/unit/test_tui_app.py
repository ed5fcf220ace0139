"""Pilot tests: drive every view of `stacklens top` with keys against fake sources."""

from __future__ import annotations

import asyncio
import functools

import pytest
from textual.widgets import DataTable, OptionList, Static, TabbedContent

from stacklens.cct import Frame
from stacklens.tui.app import ProcessListScreen, ProfileScreen, StacklensApp
from stacklens.tui.help import HelpScreen
from stacklens.tui.source import FileSource, LocalSource
from stacklens.tui.testing import FakeProcesses, FakeSource, sample_snapshot
from stacklens.tui.widgets import CCTView, IcicleView, LineTable

from stacklens.cct import CCT, METRICS, diff


def pilot_test(fn):
    """Run an async pilot test without pytest-asyncio (not in the test dependencies)."""

    @functools.wraps(fn)
    def run(*args, **kwargs):
        asyncio.run(fn(*args, **kwargs))

    return run


async def settle(app, pilot) -> None:
    """Let the fetch workers finish and their messages land."""
    for _ in range(3):
        await pilot.pause()
        await app.workers.wait_for_complete()
    await pilot.pause()


def tree_text(app) -> str:
    return "\n".join(app.screen.query_one(CCTView).visible_lines())


def status(app) -> str:
    return str(app.screen.query_one("#status", Static).render())


def banner(app) -> str:
    b = app.screen.query_one("#banner", Static)
    return str(b.render()) if b.display else ""


def drawn_lines(widget) -> list[str]:
    """Every line a widget draws (scrolled out of view or not), as plain text."""
    from textual.geometry import Region

    return ["".join(seg.text for seg in strip).rstrip() for strip in widget.render_lines(Region(0, 0, *widget.size))]


def make_app(**kw) -> StacklensApp:
    src = kw.pop("source", None) or FakeSource(sample_snapshot())
    return StacklensApp(source=src, **kw)


@pilot_test
async def test_tree_shows_hot_path_with_inclusive_and_exclusive_columns():
    app = make_app()
    async with app.run_test(size=(160, 40)) as pilot:
        await settle(app, pilot)
        text = tree_text(app)
        lines = text.splitlines()
        # the hot path is expanded on the first snapshot; the single-child chain is one row
        assert "train_step  train.py:42" in lines[0] and "▼" in lines[0]
        assert "forward  model.py:88 › op aten::linear › op aten::addmm" in lines[1]
        assert "6.4ms" in lines[1] and "87.7%" in lines[1]
        assert "7.3ms" in lines[0] and "0ns" in lines[0]  # inclusive 7.3 ms, exclusive 0
        assert "metric gpu time" in status(app)
        assert "drops 3" in status(app)
        assert "cumulative" in status(app)


@pilot_test
async def test_expand_collapse_and_move_with_keys():
    app = make_app()
    async with app.run_test(size=(160, 40)) as pilot:
        await settle(app, pilot)
        view = app.screen.query_one(CCTView)
        assert len(view.rows) == 3
        await pilot.press("enter")  # collapse the root chain
        assert len(view.rows) == 1 and "▶" in tree_text(app)
        await pilot.press("right")  # expand again
        assert len(view.rows) == 3
        await pilot.press("down")
        assert view.current.frames[0].name == "forward"
        await pilot.press("left")  # a leaf: left goes to the parent row
        assert view.cursor == 0
        await pilot.press("c")  # chains off: one row per frame
        assert "forward" not in tree_text(app).splitlines()[0]
        assert any(r.frames == (Frame.python("/srv/job/train.py", "main", 101),) for r in view.rows)


@pilot_test
async def test_sort_and_metric_switch():
    app = make_app()
    async with app.run_test(size=(160, 40)) as pilot:
        await settle(app, pilot)
        await pilot.press("m")  # gpu_time_ns -> kernel_count
        assert "metric kernel count" in status(app)
        lines = tree_text(app).splitlines()
        assert "aten::relu" in lines[1]  # 96 kernels beat the GEMM's 48
        await pilot.press("M")
        await pilot.press("s")  # sort by exclusive, then by name
        assert "by exclusive" in str(app.screen.query_one("#tree-header", Static).render())
        await pilot.press("s")
        lines = tree_text(app).splitlines()
        assert "model.py:88" in lines[1] and "model.py:90" in lines[2]
        # cpu samples: the loader and the .item() path now show up
        for _ in range(5):
            await pilot.press("m")
        assert "metric cpu time" in status(app)   # samples at the snapshot's 99 Hz
        assert "__next__" in tree_text(app)


@pilot_test
async def test_unavailable_metric_says_unavailable_not_zero():
    app = make_app(source=FakeSource(sample_snapshot(gpu=False)))
    async with app.run_test(size=(120, 30)) as pilot:
        await settle(app, pilot)
        assert "unavailable: gpu time, kernel count" in status(app)
        assert "metric cpu time" in status(app)  # the default skips unmeasured metrics
        screen = app.screen
        screen.metric = "gpu_time_ns"
        screen.refresh_views()
        await pilot.pause()
        msg = str(screen.query_one("#tree-empty", Static).render())
        assert "gpu time: unavailable" in msg and "--agent" in msg
        assert screen.query_one(CCTView).rows == []


@pilot_test
async def test_window_switch_and_diff_ask_the_source():
    src = FakeSource(sample_snapshot())
    app = make_app(source=src)
    async with app.run_test(size=(120, 30)) as pilot:
        await settle(app, pilot)
        await pilot.press("w")
        await settle(app, pilot)
        assert src.calls[-1] == (10.0, False)
        assert "last 10 s" in status(app)
        await pilot.press("w")
        await settle(app, pilot)
        assert src.calls[-1] == (60.0, False)
        await pilot.press("d")
        await settle(app, pilot)
        assert src.calls[-1] == (60.0, True)
        assert "diff last 60 s vs the 60 s before" in status(app)
        assert "+7.3ms" in tree_text(app)  # diffs are signed
        await pilot.press("w")  # back to cumulative: no diff
        await settle(app, pilot)
        assert src.calls[-1] == (None, False)


@pilot_test
async def test_pause_stops_fetching():
    src = FakeSource(sample_snapshot())
    app = StacklensApp(source=src, interval_s=0.05)
    async with app.run_test(size=(120, 30)) as pilot:
        await settle(app, pilot)
        await pilot.press("p")
        assert "PAUSED" in status(app)
        await settle(app, pilot)
        n = len(src.calls)
        await pilot.pause(0.3)
        await settle(app, pilot)
        assert len(src.calls) == n
        await pilot.press("p")
        await pilot.pause(0.3)
        await settle(app, pilot)
        assert len(src.calls) > n


@pilot_test
async def test_numbers_update_with_new_snapshots():
    snaps = [sample_snapshot(1), sample_snapshot(2)]
    src = FakeSource(lambda w, d: snaps[0])
    app = make_app(source=src)
    async with app.run_test(size=(120, 30)) as pilot:
        await settle(app, pilot)
        assert "7.3ms" in tree_text(app).splitlines()[0]
        await pilot.press("down")
        snaps[0] = snaps[1]
        await pilot.press("r")
        await settle(app, pilot)
        assert "14.6ms" in tree_text(app).splitlines()[0]
        assert app.screen.query_one(CCTView).cursor == 1  # the cursor stays on its row


@pilot_test
async def test_search_expands_and_selects_matches():
    app = make_app()
    async with app.run_test(size=(160, 40)) as pilot:
        await settle(app, pilot)
        await pilot.press("m", "m", "m", "m", "m")  # cpu samples: every path counts
        await pilot.press("home", "enter")  # collapse everything
        assert len(app.screen.query_one(CCTView).rows) == 1
        await pilot.press("slash")
        await pilot.press(*"read")
        await pilot.press("enter")
        view = app.screen.query_one(CCTView)
        assert view.current is not None and view.current.frames[-1].name == "read"
        assert "match 1/1 for 'read'" in status(app)
        await pilot.press("slash", *"kernel", "enter")  # two kernels: n cycles
        first = view.current.frames[-1].name
        await pilot.press("n")
        assert view.current.frames[-1].name != first
        await pilot.press("slash", *"nothing-like-this", "enter")
        assert "no frame matches" in status(app)


@pilot_test
async def test_flame_view_zoom():
    app = make_app()
    async with app.run_test(size=(100, 30)) as pilot:
        await settle(app, pilot)
        await pilot.press("f")
        assert app.screen.query_one(TabbedContent).active == "flame"
        icicle = app.screen.query_one(IcicleView)
        lines = icicle.visible_lines()
        assert lines[0].strip() == "[root]"
        assert "forward" in lines[4]
        await pilot.press("down", "down", "down", "down")
        assert "py:/srv/job/model.py:forward:88" in str(app.screen.query_one("#flame-detail", Static).render())
        await pilot.press("enter")  # zoom in on forward
        assert icicle.visible_lines()[0].strip().startswith("forward")
        await pilot.press("backspace")
        assert icicle.visible_lines()[0].strip() == "train_step  train.py:42"


@pilot_test
async def test_hotspots_table_and_jump_to_tree():
    app = make_app()
    async with app.run_test(size=(160, 40)) as pilot:
        await settle(app, pilot)
        await pilot.press("h")
        table = app.screen.query_one("#hot-table", LineTable)
        lines = table.plain_lines()
        assert len(lines) == 2  # two kernels carry GPU time
        first = lines[0].split()
        # gpu time, its share, cpu time (3 samples at 99 Hz), sync wait
        assert first[:4] == ["6.4ms", "87.7%", "30.3ms", "0ns"] and "sm90_xmma_gemm_f32f32_tn" in first
        assert "forward  model.py:88 › aten::addmm" in lines[0]
        head = str(app.screen.query_one("#hot-header", Static).render())
        assert head.split()[:7] == ["gpu", "time", "share", "cpu", "time", "sync", "wait"]
        await pilot.press("down", "enter")
        assert app.screen.query_one(TabbedContent).active == "tree"
        assert app.screen.query_one(CCTView).current.frames[-1].name == "vectorized_elementwise_kernel"


@pilot_test
async def test_advice_panel_lists_findings_and_jumps():
    app = make_app()
    async with app.run_test(size=(160, 40)) as pilot:
        await settle(app, pilot)
        await pilot.press("a")
        await settle(app, pilot)
        ol = app.screen.query_one("#advice-list", OptionList)
        assert ol.option_count == 2
        first = str(ol.get_option_at_index(0).prompt)
        assert "[high] sync-stall" in first and "fix: keep the loss on the GPU" in first
        assert "estimated saving: 31%" in first
        await pilot.press("enter")  # go to the .item() path: it has no GPU time
        assert app.screen.query_one(TabbedContent).active == "tree"
        assert "has no gpu time; press m" in status(app)


@pilot_test
async def test_advice_message_when_source_has_none():
    app = make_app(source=FakeSource(sample_snapshot(), advice="advice needs stacklens.analyzer, which this installation lacks"))
    async with app.run_test(size=(120, 30)) as pilot:
        await settle(app, pilot)
        await pilot.press("a")
        await settle(app, pilot)
        ol = app.screen.query_one("#advice-list", OptionList)
        assert "needs stacklens.analyzer" in str(ol.get_option_at_index(0).prompt)


@pilot_test
async def test_source_view_shows_lines_around_the_python_frame(tmp_path):
    src_file = tmp_path / "train.py"
    src_file.write_text("\n".join(f"line_{i} = {i}" for i in range(1, 61)) + "\n")
    t = CCT(METRICS, max_nodes=None)
    t.add_many((Frame.python(str(src_file), "train_step", 30), Frame.op("aten::mm"), Frame.kernel("gemm")), {"gpu_time_ns": 1000})
    app = make_app(source=FakeSource(t.snapshot()))
    async with app.run_test(size=(120, 40)) as pilot:
        await settle(app, pilot)
        await pilot.press("o")
        await pilot.pause()
        text = str(app.screen.query_one("#source-view", Static).render())
        rendered = app.screen.query_one("#source-view", Static)
        assert app.screen.query_one(TabbedContent).active == "source"
        # the Group renders to lines that include the hot line and its neighbours
        lines = [seg.text for strip in rendered.render_lines(rendered.region.reset_offset) for seg in strip]
        joined = "".join(lines)
        assert "line_30 = 30" in joined and "line_20 = 20" in joined
        assert "train_step" in str(app.screen.query_one("#source-head", Static).render())
        assert text  # rendered something


@pilot_test
async def test_source_view_unreadable_file_is_a_message():
    app = make_app()
    async with app.run_test(size=(120, 30)) as pilot:
        await settle(app, pilot)
        await pilot.press("o")
        await pilot.pause()
        assert "source not readable" in str(app.screen.query_one("#source-view", Static).render())


@pilot_test
async def test_empty_tree_is_a_message():
    empty = CCT(METRICS, max_nodes=None).snapshot()
    app = make_app(source=FakeSource(empty))
    async with app.run_test(size=(120, 30)) as pilot:
        await settle(app, pilot)
        msg = str(app.screen.query_one("#tree-empty", Static).render())
        assert "the profile is empty yet" in msg
        for key in ("f", "h", "a", "o", "t", "m", "s", "w", "d", "slash", "x", "enter", "n"):
            await pilot.press(key)
        await settle(app, pilot)
        assert app.is_running


@pilot_test
async def test_daemon_going_away_keeps_last_profile_and_says_so():
    src = FakeSource(sample_snapshot())
    app = make_app(source=src)
    async with app.run_test(size=(120, 30)) as pilot:
        await settle(app, pilot)
        src.error = "lost the daemon: stacklensd is not reachable at /tmp/s.sock"
        await pilot.press("r")
        await settle(app, pilot)
        assert "lost the daemon" in banner(app)
        assert "7.3ms" in tree_text(app)  # still showing the last profile
        src.error = ""
        await pilot.press("r")
        await settle(app, pilot)
        assert banner(app) == ""


@pilot_test
async def test_source_raising_is_a_message_not_a_traceback():
    class Broken(FakeSource):
        def fetch(self, window_s, diff=False):
            raise RuntimeError("boom")

    app = make_app(source=Broken(None))
    async with app.run_test(size=(120, 30)) as pilot:
        await settle(app, pilot)
        assert "fetch failed: RuntimeError: boom" in banner(app)
        assert app.is_running


@pilot_test
async def test_target_exit_stops_polling_and_says_so():
    class Session:
        pid = 999
        state = "attached"

        def snapshot(self, window_s=None):
            return sample_snapshot()

        def stats(self):
            return {"bpf_drops": 2}

    sess = Session()
    app = StacklensApp(source=LocalSource(sess, name="demo"), interval_s=0.05)
    async with app.run_test(size=(120, 30)) as pilot:
        await settle(app, pilot)
        assert "drops 2" in status(app)
        sess.state = "exited"
        await pilot.pause(0.2)
        await settle(app, pilot)
        assert "process 999 exited; showing its last profile" in banner(app)
        assert app.screen._timer is None
        assert "7.3ms" in tree_text(app)


@pilot_test
async def test_local_source_diff_and_windows():
    calls = []

    class Session:
        pid = 1
        state = "attached"

        def snapshot(self, window_s=None):
            calls.append(window_s)
            return sample_snapshot(2 if window_s == 20.0 else 1)

        def stats(self):
            return {}

    f = LocalSource(Session()).fetch(10.0, diff=True)
    assert calls == [10.0, 20.0]
    # last 10 s (x1) minus the 10 s before (x2 - x1 = x1): zero everywhere
    assert f.snapshot.total("gpu_time_ns") == 0 and f.error == ""


@pilot_test
async def test_file_source_has_no_windows(tmp_path):
    app = StacklensApp(source=FileSource(sample_snapshot(), "run.json.gz"))
    async with app.run_test(size=(120, 30)) as pilot:
        await settle(app, pilot)
        assert app.screen.sub_title == "run.json.gz" and status(app).startswith("file · cumulative")
        offered = {b.binding.action for b in app.screen.active_bindings.values()}
        # issue 45: w, d, p did nothing there; they are not offered (nor r, x)
        assert not offered & {"window", "diff", "pause", "refresh", "detach"}, offered
        assert {"view('tree')", "metric(1)", "search"} <= offered
        before = status(app)
        await pilot.press("w", "d", "p")
        assert status(app) == before and app.screen.window_s is None and not app.screen.diff
        assert app.screen._timer is None


@pilot_test
async def test_process_list_attach_detach_and_open():
    procs = FakeProcesses()
    app = StacklensApp(processes=procs)
    async with app.run_test(size=(120, 30)) as pilot:
        await settle(app, pilot)
        assert isinstance(app.screen, ProcessListScreen)
        table = app.screen.query_one("#procs", DataTable)
        assert table.row_count == 2
        row0 = [str(c) for c in table.get_row_at(0)]
        assert row0[:3] == ["4242", "python", "attached"] and row0[5] == "unavailable"
        await pilot.press("down", "a")
        await settle(app, pilot)
        assert procs.attached == [5151]
        assert "attached to 5151" in banner(app)
        assert [str(c) for c in table.get_row_at(1)][2] == "attached"
        await pilot.press("x")
        await settle(app, pilot)
        assert procs.detached == [5151]
        assert [str(c) for c in table.get_row_at(1)][2] == "detached"
        await pilot.press("up", "enter")
        await settle(app, pilot)
        assert isinstance(app.screen, ProfileScreen) and app.screen.pid == 4242
        assert "train_step" in tree_text(app)
        await pilot.press("x")  # detach from the profile screen
        await settle(app, pilot)
        assert procs.detached == [5151, 4242]
        await pilot.press("escape")
        assert isinstance(app.screen, ProcessListScreen)


@pilot_test
async def test_process_list_daemon_down_is_a_message():
    procs = FakeProcesses()
    procs.down = True
    app = StacklensApp(processes=procs)
    async with app.run_test(size=(120, 30)) as pilot:
        await settle(app, pilot)
        assert "lost the daemon" in banner(app) and "stacklensd" in banner(app)
        await pilot.press("a")
        await settle(app, pilot)
        assert app.is_running
        procs.down = False
        await pilot.press("r")
        await settle(app, pilot)
        assert banner(app) == ""


@pilot_test
async def test_open_with_pid_goes_straight_to_the_profile():
    app = StacklensApp(processes=FakeProcesses(), pid=4242)
    async with app.run_test(size=(120, 30)) as pilot:
        await settle(app, pilot)
        assert isinstance(app.screen, ProfileScreen)
        await pilot.press("escape")
        assert isinstance(app.screen, ProcessListScreen)


@pilot_test
async def test_mouse_click_selects_and_toggles():
    app = make_app()
    async with app.run_test(size=(160, 40)) as pilot:
        await settle(app, pilot)
        view = app.screen.query_one(CCTView)
        await pilot.click(CCTView, offset=(60, 1))
        assert view.cursor == 1
        await pilot.click(CCTView, offset=(60, 0))
        await pilot.click(CCTView, offset=(60, 0))  # second click on the cursor row toggles
        assert len(view.rows) == 1
        await pilot.click("Tab#--content-tab-hotspots")
        await pilot.pause()
        assert app.screen.query_one(TabbedContent).active == "hotspots"


@pytest.mark.parametrize("duration", [0.3])
@pilot_test
async def test_duration_exits(duration):
    app = make_app(duration_s=duration)
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.pause(duration + 0.3)
        assert not app.is_running


@pilot_test
async def test_search_box_takes_letters_and_escape_cancels():
    app = make_app()
    async with app.run_test(size=(120, 30)) as pilot:
        await settle(app, pilot)
        await pilot.press("slash", "q", "m", "f")  # would quit / switch metric / flame outside the box
        assert app.is_running
        box = app.screen.query_one("#search")
        assert box.display and box.value == "qmf"
        assert "metric gpu time" in status(app)
        assert app.screen.query_one(TabbedContent).active == "tree"
        await pilot.press("escape")
        assert not box.display and app.screen.focused is app.screen.query_one(CCTView)


@pilot_test
async def test_expand_hot_path_from_a_collapsed_row():
    app = make_app()
    async with app.run_test(size=(160, 40)) as pilot:
        await settle(app, pilot)
        for _ in range(5):
            await pilot.press("m")  # cpu samples: the root chain has three children
        await pilot.press("home", "enter")
        view = app.screen.query_one(CCTView)
        assert len(view.rows) == 1
        await pilot.press("e")
        names = [f.name for r in view.rows for f in r.frames]
        assert "__next__" in names and "read" in names  # the heaviest child (the loader) is open


@pilot_test
async def test_hotspots_click_selects_and_second_click_jumps():
    app = make_app()
    async with app.run_test(size=(160, 40)) as pilot:
        await settle(app, pilot)
        await pilot.press("h")
        await pilot.click(LineTable, offset=(5, 1))
        assert app.screen.query_one(LineTable).cursor == 1
        await pilot.click(LineTable, offset=(5, 1))
        await pilot.pause()
        assert app.screen.query_one(TabbedContent).active == "tree"
        assert app.screen.query_one(CCTView).current.frames[-1].name == "vectorized_elementwise_kernel"


@pilot_test
async def test_model_view_of_the_recorded_training_run_and_v_for_the_full_view():
    from stacklens.cct import export

    recorded = export.load(__import__("pathlib").Path(__file__).resolve().parents[1] / "data" / "cpu_gpt2_train" / "problem.json")
    app = StacklensApp(source=FileSource(recorded, "problem.json"))
    async with app.run_test(size=(200, 50)) as pilot:
        await settle(app, pilot)
        # a CPU recording: GPU time was not measured, so it opens on CPU time (samples at the
        # recorded cpu_hz), in the model view
        assert "metric cpu time" in status(app) and "model view" in status(app)
        for _ in range(len(METRICS)):   # to py samples: the agent's, which name module paths
            if app.screen.metric == "py_samples":
                break
            await pilot.press("m")
        await settle(app, pilot)
        assert "metric py samples" in status(app)
        await pilot.press("e")          # expand the hot path below the cursor
        await settle(app, pilot)
        text = tree_text(app)
        assert "GPT2LMHeadModel" in text and "transformer · GPT2Model" in text
        assert "_call_impl" not in text and "wrapper" not in text
        assert app.screen.raw is recorded and app.screen.snap is not recorded
        await pilot.press("v")
        await settle(app, pilot)
        assert "model view" not in status(app) and app.screen.snap is recorded
        for key in ("down", "down", "e"):   # the forward's line (the hot path is loss.backward())
            await pilot.press(key)
        await settle(app, pilot)
        assert "_call_impl" in tree_text(app)
        await pilot.press("v")
        await settle(app, pilot)
        assert "model view" in status(app) and "_call_impl" not in tree_text(app)


@pilot_test
async def test_a_profile_without_module_calls_opens_in_the_full_view():
    app = make_app()
    async with app.run_test(size=(160, 40)) as pilot:
        await settle(app, pilot)
        assert app.screen.view_mode == "full" and "model view" not in status(app)
        await pilot.press("v")
        await settle(app, pilot)
        assert app.screen.view_mode == "model" and "model view" in status(app)


# ---- issue 30: time units, help, measured metrics, signed diff shares, per-line values, CPU% ----


def cpu_only_snapshot(meta: dict):
    t = CCT(METRICS, max_nodes=None)
    t.add_many((Frame.python("/srv/job/train.py", "main", 5), Frame.op("aten::mm")), {"cpu_samples": 297})
    t.add_many((Frame.python("/srv/job/train.py", "load", 9),), {"cpu_samples": 99})
    return t.snapshot(meta=meta, unavailable={"gpu_time_ns", "kernel_count"})


@pilot_test
async def test_cpu_samples_show_as_time_and_share_where_the_rate_is_known():
    app = make_app(source=FakeSource(cpu_only_snapshot({"cpu_hz": 99})))
    async with app.run_test(size=(160, 40)) as pilot:
        await settle(app, pilot)
        assert "metric cpu time" in status(app)
        lines = tree_text(app).splitlines()
        assert "3.00s" in lines[0] and "75.0%" in lines[0] and "aten::mm" in lines[0]   # 297 samples / 99 Hz
        assert "1.00s" in lines[1] and "25.0%" in lines[1]
        assert "cpu time" in str(app.screen.query_one("#tree-header", Static).render())
        await pilot.press("h")
        await settle(app, pilot)
        head = str(app.screen.query_one("#hot-header", Static).render())
        assert "cpu time" in head and "share" in head
        hot = app.screen.query_one(LineTable).plain_lines()
        assert "3.00s" in hot[0] and "75.0%" in hot[0]


@pilot_test
async def test_cpu_samples_stay_counts_labelled_samples_where_the_rate_is_unknown():
    app = make_app(source=FakeSource(cpu_only_snapshot({})))
    async with app.run_test(size=(160, 40)) as pilot:
        await settle(app, pilot)
        assert "metric cpu samples" in status(app)
        line = tree_text(app).splitlines()[0]
        assert "297" in line and "75.0%" in line and "s " not in line.split("%")[0]


@pilot_test
async def test_question_mark_opens_help_listing_every_binding():
    app = make_app()
    async with app.run_test(size=(160, 50)) as pilot:
        await settle(app, pilot)
        keys = str(app.screen.query_one("#keys", Static).render())
        assert keys.startswith("? help") and all(
            b.description in keys for b in ProfileScreen.BINDINGS if b.show)   # the key line, generated too
        await pilot.press("question_mark")
        await pilot.pause()
        assert isinstance(app.screen, HelpScreen)
        rows = app.screen.rows()
        listed = {(what) for _, _, what in rows}
        for widget in (ProfileScreen, CCTView, IcicleView, LineTable):
            for b in widget.BINDINGS:
                assert b.description in listed if b.description else True
        assert len(rows) == sum(len(w.BINDINGS) for w in (ProfileScreen, CCTView, IcicleView, LineTable, HelpScreen))
        assert ("anywhere", "m", "metric") in rows and ("anywhere", "/", "search") in rows
        assert ("anywhere", "t 1", "tree") in rows and ("tree", "pgdn", "page 1") in rows
        text = "\n".join(drawn_lines(app.screen.query_one("#help-table", Static)))
        assert "detach" in text and "hot path" in text and "zoom out" in text
        await pilot.press("escape")
        await pilot.pause()
        assert isinstance(app.screen, ProfileScreen)


@pilot_test
async def test_help_on_the_process_list():
    app = StacklensApp(processes=FakeProcesses())
    async with app.run_test(size=(120, 30)) as pilot:
        await settle(app, pilot)
        await pilot.press("question_mark")
        await pilot.pause()
        assert isinstance(app.screen, HelpScreen)
        assert ("processes", "a", "attach") in app.screen.rows()
        await pilot.press("question_mark")
        await pilot.pause()
        assert isinstance(app.screen, ProcessListScreen)


@pilot_test
async def test_m_cycles_only_through_measured_metrics():
    snap = sample_snapshot(gpu=False)
    app = make_app(source=FakeSource(snap))
    async with app.run_test(size=(120, 30)) as pilot:
        await settle(app, pilot)
        seen = set()
        for key in ("m",) * 8 + ("M",) * 8:
            await pilot.press(key)
            seen.add(app.screen.metric)
            assert "unavailable (" not in str(app.screen.query_one("#tree-empty", Static).render())
        assert seen == {"launch_count", "api_cpu_ns", "sync_wait_ns", "cpu_samples", "alloc_bytes", "copy_bytes"}


def diff_source():
    """`d` shows the last 10 s minus the 10 s before: the GEMM grew, the relu shrank."""
    before = sample_snapshot()
    t = CCT(METRICS, max_nodes=None)
    gemm = (Frame.python("/srv/job/train.py", "train_step", 42), Frame.op("aten::linear"))
    t.add_many(gemm, {"gpu_time_ns": 9_000_000})
    t.add_many((Frame.python("/srv/job/train.py", "train_step", 43), Frame.op("aten::relu")), {"gpu_time_ns": 1_000_000})
    t.add_many((Frame.python("/srv/job/train.py", "train_step", 44), Frame.op("aten::relu")), {"gpu_time_ns": 4_000_000})
    recent = t.snapshot()
    older = CCT(METRICS, max_nodes=None)
    older.add_many(gemm, {"gpu_time_ns": 5_000_000})
    older.add_many((Frame.python("/srv/job/train.py", "train_step", 44), Frame.op("aten::relu")), {"gpu_time_ns": 6_000_000})
    delta = diff(recent, older.snapshot())
    return FakeSource(lambda window_s, is_diff: delta if is_diff else before)


@pilot_test
async def test_diff_share_keeps_its_sign():
    app = make_app(source=diff_source())
    async with app.run_test(size=(160, 40)) as pilot:
        await settle(app, pilot)
        await pilot.press("d")
        await settle(app, pilot)
        assert "diff" in status(app)
        lines = tree_text(app).splitlines()
        grew = next(ln for ln in lines if "train.py:42" in ln)
        shrank = next(ln for ln in lines if "train.py:44" in ln)
        # net change +3 ms: +4 ms is +133.3% of it, -2 ms is -66.7%
        assert "+4.0ms" in grew and "+133.3%" in grew
        assert "-2.0ms" in shrank and "-66.7%" in shrank
        await pilot.press("h")
        await settle(app, pilot)
        hot = app.screen.query_one(LineTable).plain_lines()
        assert any("+133.3%" in ln for ln in hot) and any("-66.7%" in ln for ln in hot)


@pilot_test
async def test_source_view_shows_each_line_value(tmp_path):
    src_file = tmp_path / "train.py"
    src_file.write_text("\n".join(f"line_{i} = {i}" for i in range(1, 61)) + "\n")
    t = CCT(METRICS, max_nodes=None)
    main = Frame.python(str(src_file), "main", 10)
    t.add_many((main, Frame.python(str(src_file), "train_step", 30), Frame.op("aten::mm")), {"cpu_samples": 198})
    t.add_many((main, Frame.python(str(src_file), "load", 33)), {"cpu_samples": 99})
    app = make_app(source=FakeSource(t.snapshot(meta={"cpu_hz": 99})))
    async with app.run_test(size=(120, 40)) as pilot:
        await settle(app, pilot)
        await pilot.press("down")
        await pilot.press("o")
        await settle(app, pilot)
        text = drawn_lines(app.screen.query_one("#source-view", Static))
        by_line = {ln.split("│")[0].split()[-1]: ln for ln in text if "│" in ln}
        assert "cpu time per line" in str(app.screen.query_one("#source-head", Static).render())
        assert "3.00s" in by_line["10"] and "100.0%" in by_line["10"]     # main: everything
        assert "2.00s" in by_line["30"] and "66.7%" in by_line["30"] and "line_30 = 30" in by_line["30"]
        assert "1.00s" in by_line["33"] and "33.3%" in by_line["33"]
        assert "%" not in by_line["31"]                                   # no value: blank, not 0


@pilot_test
async def test_process_list_shows_cpu_percent_from_two_readings():
    procs = FakeProcesses()
    app = StacklensApp(processes=procs)
    async with app.run_test(size=(140, 30)) as pilot:
        await settle(app, pilot)
        table = app.screen.query_one("#procs", DataTable)
        cpu = [str(table.get_row_at(i)[4]) for i in range(2)]
        assert cpu == ["…", "…"] and procs.listings == 1   # one reading: no rate yet
        await pilot.press("r")
        await settle(app, pilot)
        cpu = [str(table.get_row_at(i)[4]) for i in range(2)]
        assert procs.listings == 2 and cpu == ["150.0%", "25.0%"]   # CPU seconds per second, as top
        del procs.cpu_rate[5151]                                     # a reply without CPU time
        await pilot.press("r")
        await settle(app, pilot)
        assert str(table.get_row_at(1)[4]) == "unavailable"
