"""`stacklens dump` without a process: the frame walker and the GIL reader on fake memory
(tests/fakes/memory.py) with the real layout table, the job analysis on a fake `JobHost`, and
the text forms. No privilege."""

from __future__ import annotations

import struct

import pytest

from stacklens.cli.dump import job_text, process_text
from stacklens.pystacks.dumpjob import (RankProc, analyze, collective_frame, dump_job, find_ranks,
                                      parse_environ)
from stacklens.introspect import python_layouts as pl
from stacklens.pystacks.dump import (ProcessDump, PyFrameText, ThreadDump, read_gil, stable_stack,
                                     walk_stack)
from stacklens.pystacks.python_process import PyInterpreter
from tests.fakes.memory import FakeMemory

L311 = pl.LAYOUTS[(3, 11)]
L312 = pl.LAYOUTS[(3, 12)]
TSTATE, CFRAME, CODE_A, CODE_B = 0x1000, 0x2000, 0x5000, 0x6000


def _u64(buf: bytearray, off: int, v: int) -> None:
    struct.pack_into("<Q", buf, off, v)


def _code(lay, fn: int, name: int) -> bytearray:
    b = bytearray(0x200)
    _u64(b, lay.code_filename, fn)
    _u64(b, lay.code_name, name)
    return b


def _frame(lay, prev: int, code: int, offset: int, owner: int = 0) -> bytearray:
    b = bytearray(lay.frame_read_size())
    _u64(b, lay.frame_previous, prev)
    _u64(b, lay.frame_code, code)
    _u64(b, lay.frame_instr, code + lay.code_adaptive + offset)
    b[lay.frame_owner] = owner
    return b


def _mem_311(frames: dict[int, bytearray], first: int) -> FakeMemory:
    ts, cf = bytearray(0x100), bytearray(0x40)
    _u64(ts, L311.tstate_frame, CFRAME)
    _u64(cf, L311.cframe_current_frame, first)
    return FakeMemory({TSTATE: ts, CFRAME: cf, CODE_A: _code(L311, 0x111, 0x222),
                       CODE_B: _code(L311, 0x333, 0x444), **frames})


def test_walk_311_innermost_first_with_offsets_and_tags():
    mem = _mem_311({0x3000: _frame(L311, 0x3100, CODE_A, 10), 0x3100: _frame(L311, 0, CODE_B, 4)}, 0x3000)
    raw = walk_stack(mem, L311, TSTATE)
    assert raw.status == 0 and not raw.truncated
    assert [(f.code, f.offset, f.tag) for f in raw.frames] == [(CODE_A, 10, 0x111 ^ 0x222),
                                                                (CODE_B, 4, 0x333 ^ 0x444)]


def test_walk_ends_marked_on_an_unreadable_frame_and_on_a_cycle():
    mem = _mem_311({0x3000: _frame(L311, 0x9000, CODE_A, 0)}, 0x3000)
    raw = walk_stack(mem, L311, TSTATE)
    assert raw.status == 4 and len(raw.frames) == 1
    loop = _mem_311({0x3000: _frame(L311, 0x3100, CODE_A, 0), 0x3100: _frame(L311, 0x3000, CODE_B, 0)}, 0x3000)
    raw = walk_stack(loop, L311, TSTATE)
    assert raw.truncated and len(raw.frames) == 2


def test_walk_312_skips_shim_frames():
    ts, cf = bytearray(0x100), bytearray(0x40)
    _u64(ts, L312.tstate_frame, CFRAME)
    _u64(cf, L312.cframe_current_frame, 0x3000)
    mem = FakeMemory({TSTATE: ts, CFRAME: cf, CODE_A: _code(L312, 1, 2),
                      0x3000: _frame(L312, 0x3100, CODE_A, 2),
                      0x3100: _frame(L312, 0x3200, 0, 0, owner=L312.owner_shim_min),
                      0x3200: _frame(L312, 0, CODE_A, 6)})
    assert [f.offset for f in walk_stack(mem, L312, TSTATE).frames] == [2, 6]


class _Moving(FakeMemory):
    """Each read of the current-frame pointer flips between two chains: a thread that runs."""

    def __init__(self, regions, alt: int) -> None:
        super().__init__(regions)
        self.alt, self.reads = alt, 0

    def read(self, addr: int, n: int) -> bytes:
        if addr == CFRAME + L311.cframe_current_frame:
            self.reads += 1
            return struct.pack("<Q", 0x3000 if self.reads % 2 else self.alt)
        return super().read(addr, n)


def test_stable_stack_agrees_on_functions_not_on_lines():
    f = {0x3000: _frame(L311, 0, CODE_A, 2), 0x3100: _frame(L311, 0, CODE_A, 8),
         0x3200: _frame(L311, 0, CODE_B, 8)}
    raw, ok = stable_stack(_Moving(_mem_311(f, 0).regions, alt=0x3100), L311, TSTATE)
    assert ok and raw.frames[0].code == CODE_A          # only the line moved
    raw, ok = stable_stack(_Moving(_mem_311(f, 0).regions, alt=0x3200), L311, TSTATE)
    assert not ok                                       # another function each time


def _interp(lay, runtime=0x10000, main=0x20000) -> PyInterpreter:
    return PyInterpreter(1, "python", "python", lay.version, 0, runtime, 0, lay, main)


def test_read_gil_from_the_runtime_311_and_the_interpreter_312():
    rt = bytearray(0x400)
    struct.pack_into("<i", rt, L311.gil_locked, 1)
    _u64(rt, L311.gil_holder, TSTATE)
    assert read_gil(FakeMemory({0x10000: rt}), _interp(L311)) == ("held", TSTATE)
    it = bytearray(0x800)
    _u64(it, L312.gil_holder, TSTATE)               # last holder, but unlocked now
    assert read_gil(FakeMemory({0x20000: it}), _interp(L312)) == ("released", 0)
    struct.pack_into("<i", it, L312.gil_locked, 7)  # torn or not a GIL: no guess
    assert read_gil(FakeMemory({0x20000: it}), _interp(L312)) == ("unknown", 0)
    assert read_gil(FakeMemory({}), _interp(L311)) == ("unknown", 0)


@pytest.mark.parametrize("version", [(3, 10), (3, 11), (3, 12)])
def test_gil_offsets_match_the_headers(tmp_path, version):
    from tests.unit.test_python_layouts_headers import _compile_and_run

    where = "_PyRuntimeState, ceval.gil" if version < (3, 12) else "PyInterpreterState, _gil"
    got = _compile_and_run(tmp_path, version, [f"offsetof({where}.locked)", f"offsetof({where}.last_holder)"])
    lay = pl.LAYOUTS[version]
    assert got == [lay.gil_locked, lay.gil_holder] and lay.gil_in_interp == (version >= (3, 12))


# ---- the job ---------------------------------------------------------------------------------

C10D = "/site-packages/torch/distributed/distributed_c10d.py"


def _dump(pid: int, frames: list[PyFrameText]) -> ProcessDump:
    main = ThreadDump(pid, "python", "S", "futex", True, True, tuple(frames))
    other = ThreadDump(pid + 1, "gloo", "S", "futex", False, False)
    return ProcessDump(pid, "python", "3.11", "released", None, (main, other), 3.0)


def _waiting(pid: int) -> ProcessDump:
    return _dump(pid, [PyFrameText(C10D, "all_reduce", 3252),
                       PyFrameText("/site-packages/torch/distributed/c10d_logger.py",
                                   "_exception_logger.<locals>.wrapper", 83),
                       PyFrameText("/job/train.py", "step", 37)])


def _sleeping(pid: int) -> ProcessDump:
    return _dump(pid, [PyFrameText("/job/train.py", "load", 12)])


class FakeHost:
    def __init__(self, tree: dict[int, list[int]], envs: dict[int, dict[str, str]], dumps) -> None:
        self.tree, self.envs, self.dumps = tree, envs, dumps

    def children(self, pid):
        return self.tree.get(pid, [])

    def environ(self, pid):
        return self.envs.get(pid)

    def dump(self, pid):
        return self.dumps[pid]


def _env(rank: int, world: int = 2) -> dict[str, str]:
    return {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world)}


def test_find_ranks_takes_the_outermost_process_of_each_rank():
    # launcher 1 -> a shell 2 (no RANK) -> rank 0 (10, whose worker 11 inherits RANK) and rank 1 (20)
    host = FakeHost({1: [2], 2: [10, 20], 10: [11]},
                    {2: {}, 10: _env(0), 11: _env(0), 20: _env(1)}, {})
    assert [(r.rank, r.pid, r.world_size) for r in find_ranks(host, 1)] == [(0, 10, 2), (1, 20, 2)]


def test_parse_environ():
    assert parse_environ(b"RANK=1\0A=b=c\0junk\0") == {"RANK": "1", "A": "b=c"}
    assert parse_environ(None) is None


def test_the_rank_that_never_joined_is_missing():
    ranks = [RankProc(0, 10, 0, 2, 2), RankProc(1, 20, 1, 2, 2)]
    job = analyze(1, ranks, {10: _waiting(10), 20: _sleeping(20)})
    assert job.waiting() == [0]
    assert [r for r, _ in job.missing] == [1] and "never joined" in job.missing[0][1]
    r0 = job.ranks[0]
    assert r0.collective.function == "all_reduce" and r0.caller == PyFrameText("/job/train.py", "step", 37)
    text = job_text(job)
    assert "MISSING rank 1" in text and "waits in all_reduce" in text


def test_a_rank_without_a_process_is_missing():
    job = analyze(1, [RankProc(0, 10, 0, 3, 3), RankProc(2, 30, 2, 3, 3)],
                  {10: _waiting(10), 30: _waiting(30)})
    assert job.missing == ((1, "no process with this RANK under the launcher"),)


def test_all_waiting_none_missing_and_errors_reported():
    job = analyze(1, [RankProc(0, 10, 0, 2, 2), RankProc(1, 20, 1, 2, 2)],
                  {10: _waiting(10), 20: _waiting(20)})
    assert job.missing == () and job.waiting() == [0, 1]
    assert "no rank missing" in job_text(job)
    job = analyze(1, [RankProc(0, 10, 0, 2, 2), RankProc(1, 20, 1, 2, 2)],
                  {10: _waiting(10), 20: "PID 20 exited"})
    assert job.missing == ((1, "not dumped (PID 20 exited)"),)


def test_a_job_over_nodes_checks_this_nodes_ranks_only():
    # node 1 of 2: global ranks 2 and 3 of 4; rank 3 is in no collective
    ranks = [RankProc(2, 10, 0, 4, 2), RankProc(3, 20, 1, 4, 2)]
    job = analyze(1, ranks, {10: _waiting(10), 20: _sleeping(20)})
    assert [r for r, _ in job.missing] == [3]
    assert any("spans nodes" in n for n in job.notes)


def test_no_collective_frame_outside_torch_distributed():
    assert collective_frame(_dump(5, [PyFrameText("/job/mine.py", "barrier", 3)])) is None


def test_dump_job_without_ranks_says_what_to_give():
    job = dump_job(1, FakeHost({1: [2]}, {2: {}}, {}))
    assert job.ranks == () and "launcher" in job.notes[0]


def test_process_text_names_the_gil_holder_and_the_frames():
    d = _waiting(10)
    d = ProcessDump(d.pid, d.comm, d.python_version, "held", 11, d.threads, 2.0)
    text = process_text(d, only_python=True)
    assert "GIL: held by thread 11" in text
    assert "    all_reduce (" + C10D + ":3252)" in text
    assert "1 threads without Python not shown" in text
    assert d.to_json()["threads"][0]["frames"][2] == {"file": "/job/train.py", "function": "step", "line": 37}
