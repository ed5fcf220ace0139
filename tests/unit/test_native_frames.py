"""bpf.session.native_frames: what a frame-pointer walk becomes in the tree."""

from stacklens.bpf.frames import Frame
from stacklens.bpf.procmaps import ANON, UNKNOWN
from stacklens.bpf.session import TRUNCATED, native_frames

START = Frame.native("libc.so.6", "__libc_start_main")
MAIN = Frame.native("python3.11", "main")
EVAL = Frame.native("python3.11", "_PyEval_EvalFrameDefault")
VDSO = Frame.other("[vdso]")
STRIPPED = Frame.native("libcuda.so.1", "[stripped]")


def walk(*frames):
    """innermost-first addresses for outermost-first frames, and the lookup for them"""
    table = {0x1000 + i: f for i, f in enumerate(reversed(frames))}
    return list(table), table.__getitem__


def test_a_whole_walk_from_the_threads_entry_is_not_cut():
    addrs, frame = walk(START, MAIN, EVAL, STRIPPED, STRIPPED)
    assert native_frames(addrs, frame) == ((START, MAIN, EVAL, STRIPPED), False)


def test_jit_code_and_the_vdso_are_frames_not_the_end_of_the_stack():
    """A CPU sample in clock_gettime's vDSO page, or a launch under JIT code, keeps the native
    frames above it (it used to be cut to `[truncated]` there)."""
    addrs, frame = walk(START, MAIN, EVAL, ANON, ANON, EVAL, VDSO)
    assert native_frames(addrs, frame) == ((START, MAIN, EVAL, ANON, ANON, EVAL, VDSO), False)


def test_an_address_outside_every_mapping_ends_the_walk():
    addrs, frame = walk(UNKNOWN, Frame.native("libfoo.so", "bar"), EVAL, STRIPPED)
    # innermost first: STRIPPED, EVAL, bar, then garbage: cut there, marked
    assert native_frames(addrs, frame) == ((TRUNCATED, Frame.native("libfoo.so", "bar"), EVAL, STRIPPED), True)


def test_a_walk_that_does_not_reach_a_thread_entry_or_fills_the_map_is_cut():
    addrs, frame = walk(MAIN, EVAL)
    assert native_frames(addrs, frame) == ((TRUNCATED, MAIN, EVAL), True)
    deep = [START] + [EVAL] * 126
    addrs, frame = walk(*deep)
    assert native_frames(addrs, frame)[1] is True      # 127 frames: the depth limit
