"""bpf.native_stacks.native_frames: what a frame-pointer walk becomes in the tree, and the decoder's
stack lookups (its NativeStacks) over fake maps and a fake symbolizer (no root)."""

from stacklens.cct import Frame
from stacklens.bpf.procmaps import ANON, UNKNOWN
from stacklens.bpf.decode import TRUNCATED, RingDecoder, native_frames

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


class _Maps:
    """The two stack maps (bpf.decode.DecodeMaps); no op paths or Python stacks."""

    def __init__(self, stacks, stacks2):
        self.tables = {b"stacks": stacks, b"stacks2": stacks2}

    def walk_stack(self, table, key):
        return iter(self.tables[table][key])


def _decoder(stacks, stacks2, frames) -> RingDecoder:
    """A RingDecoder over the two stack maps and a symbolizer that knows `frames`."""
    import types

    return RingDecoder(4242, _Maps(stacks, stacks2), types.SimpleNamespace(frame=frames.__getitem__))


def _stack_counts(d: RingDecoder) -> dict:
    return {k: d.counts[k] for k in ("stack_lookup_failures", "truncated_stacks")}


def test_stack_ids_marked_for_the_second_map_are_read_there_with_the_caller_added():
    """A launch's walk starts at the API's first instruction and skips its direct caller (rbp is
    still the caller's); the caller from [sp] goes back in second. Ids with SL_STACK_IN_2 set
    live in `stacks2` (a collision in the first map), same id space otherwise."""
    from stacklens.bpf.events_abi import SL_STACK_IN_2
    api, app, launch, other = (Frame.native("libcuda.so.1", "cuLaunchKernel"), Frame.native("app", "main"),
                               Frame.native("libfakeapp.so", "app_forward_launches"),
                               Frame.native("libfakeapp.so", "app_backward_launches"))
    frames = {1: api, 2: app, 3: START, 4: launch, 5: other}
    s = _decoder({7: [1, 2, 3]}, {7: [1, 2, 3, 3]}, frames)
    assert s._native_stacks.from_map(7, caller=4) == (START, app, launch, api)
    assert s._native_stacks.from_map(7 | SL_STACK_IN_2, caller=5) == (START, START, app, other, api)
    assert s._native_stacks.by_id[(7, 4)] != s._native_stacks.by_id[(7 | SL_STACK_IN_2, 5)]
    assert _stack_counts(s) == {"stack_lookup_failures": 0, "truncated_stacks": 0}


def test_a_full_depth_walk_is_cut_but_the_added_caller_does_not_make_one():
    from stacklens.bpf.decode import STACK_DEPTH

    frames = {1: Frame.native("libcuda.so.1", "cuLaunchKernel"), 2: EVAL, 3: START, 4: MAIN}
    short = [1] + [2] * (STACK_DEPTH - 3) + [3]           # one short of the limit, ends at _start
    full = [1] + [2] * (STACK_DEPTH - 2) + [3]            # as deep as the map holds: maybe cut
    s = _decoder({1: short, 2: full}, {}, frames)
    out = s._native_stacks.from_map(1, caller=4)                           # + the caller: 127 addresses, not cut
    assert out[0] == START and s.counts["truncated_stacks"] == 0
    assert s._native_stacks.from_map(2, caller=4)[0] == TRUNCATED
    assert s.counts["truncated_stacks"] == 1


def test_header_and_python_agree_on_counters_and_the_stack_mark():
    """bpf/programs/stacklens.h and bpf/events_abi.py describe the same counters and marks."""
    import re
    from pathlib import Path

    from stacklens.bpf import events_abi

    text = (Path(events_abi.__file__).parent / "programs" / "stacklens.h").read_text()
    defs = dict(re.findall(r"#define (SL_C_\w+) (\d+)", text))
    used = {int(v) for k, v in defs.items() if k != "SL_C_OP_CALLS"} | {int(defs["SL_C_OP_CALLS"])}
    assert used == set(range(len(events_abi.COUNTERS)))
    assert int(re.search(r"#define SL_NCOUNTERS (\d+)", text).group(1)) >= len(events_abi.COUNTERS)
    for name, counter in (("SL_C_STACK_ERR", "stack_errors"), ("SL_C_NATIVE_REUSED", "native_stacks_reused"),
                          ("SL_C_STACK_MAP2", "stacks_in_map2"), ("SL_C_EVENTS", "events")):
        assert events_abi.COUNTERS[int(defs[name])] == counter
    assert re.search(r"#define SL_STACK_IN_2 \(1 << (\d+)\)", text).group(1) == str(
        events_abi.SL_STACK_IN_2.bit_length() - 1)


def test_a_cpu_samples_addresses_after_its_event_become_its_stack():
    """CPU samples carry their addresses after the event (SL_STACK_INLINE, `out` = bytes); a
    length past the record or the depth limit is clamped; stacks are cached by their addresses."""
    import struct

    from stacklens.bpf.decode import EVENT_SIZE

    frames = {1: EVAL, 2: MAIN, 3: START}
    s = _decoder({}, {}, frames)
    rec = bytes(8 + EVENT_SIZE) + struct.pack("<3Q", 1, 2, 3)
    assert s._native_stacks._inline_stack(memoryview(rec), 0, 24) == (START, MAIN, EVAL)
    assert s._native_stacks._inline_stack(memoryview(rec), 0, 16) == (TRUNCATED, MAIN, EVAL)   # 2 of 3: no root
    assert s._native_stacks._inline_stack(memoryview(rec), 0, 0) == (TRUNCATED,)
    assert len(s._native_stacks._inline_cache) == 3 and s.counts["truncated_stacks"] == 2


def test_a_cpu_sample_through_the_perf_fallback_keeps_its_addresses():
    """Records the ring refused come through events_fb (padded perf records) and the same decode."""
    import ctypes
    import struct

    import collections

    from stacklens.bpf.events_abi import SL_STACK_INLINE, SlEvent
    from stacklens.bpf.decode import RecordList
    from stacklens.bpf.shared import SharedProgram

    s = _decoder({}, {}, {1: EVAL, 2: MAIN, 3: START})
    prog = SharedProgram.__new__(SharedProgram)     # its record queues only: no BPF here
    prog._queues, prog._slots = collections.defaultdict(list), {4242: 0}
    prog.dropped, prog.orphans = collections.Counter(), 0
    ev = SlEvent()
    ev.kind, ev.pid, ev.stack_id, ev.out = 2, 4242, SL_STACK_INLINE, 24
    raw = bytes(ev) + struct.pack("<3Q", 1, 2, 3) + b"\0\0\0\0"      # + the perf record's padding
    buf = ctypes.create_string_buffer(raw, len(raw))
    prog._on_fallback(0, ctypes.addressof(buf), len(raw))
    rl = RecordList(prog.take(4242))                  # queued for its process
    assert s._native_stacks._inline_stack(rl.data, 0, 24) == (START, MAIN, EVAL)


def test_header_and_python_agree_on_the_inline_stack_marks():
    import re
    from pathlib import Path

    from stacklens.bpf import events_abi
    from stacklens.bpf.decode import STACK_DEPTH

    text = (Path(events_abi.__file__).parent / "programs" / "stacklens.h").read_text()
    assert int(re.search(r"#define SL_STACK_INLINE \((-?\d+)\)", text).group(1)) == events_abi.SL_STACK_INLINE
    assert int(re.search(r"#define SL_SAMPLE_DEPTH (\d+)", text).group(1)) == STACK_DEPTH
