"""pystack.h end to end: a uprobe on libc getpid records the Python stack in BPF; every event
must carry the exact Python path of tests/targets/py_calls.py, for every interpreter present.

Root + eBPF (probed by `bpf_ok`). Interpreters: pyenv's 3.10-3.13 and Debian's 3.11 here, and
Debian sid's 3.14 in a debootstrap chroot (/var/tmp/chroot-sid; also exercises paths of a
process with another root). Absent ones are skipped with the reason.
"""

from __future__ import annotations

import ctypes as ct
import os
import re
import shutil
import subprocess
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import pytest

from stacklens.pystacks.pysym import (SL_PY_NO_TSTATE, SL_PY_OK, SL_PYF_ENTRY, Frame, RawPyStack,
                                      SlPyFrame, sl_pystack_struct)
from tests.interpreters import pyenv_python
from tests.lines import read_line

ROOT = Path(__file__).resolve().parents[2]
TARGET = ROOT / "tests" / "targets" / "py_calls.py"
PROGRAM = ROOT / "bpf" / "programs" / "pystack_test.bpf.c"
SID = Path("/var/tmp/chroot-sid")
MAX_DEPTH = 48

INTERPRETERS = {
    "pyenv-3.10": [pyenv_python("3.10.13")],
    "pyenv-3.11": [pyenv_python("3.11.7")],
    "debian-3.11": ["/usr/bin/python3.11"],
    "pyenv-3.12": [pyenv_python("3.12.1")],
    "pyenv-3.13": [pyenv_python("3.13.0")],
    "sid-3.14-chroot": ["chroot", str(SID), "python3"],
}

COUNTS = {"abc": 7, "xy": 5, "thread": 4, "pre": 3, "gen": 6, "coro": 3, "rec": 2, "qsort": 4,
          "native": 3}


def markers() -> dict[str, int]:
    out = {}
    for i, line in enumerate(TARGET.read_text().splitlines(), 1):
        m = re.search(r"# @(\w+)", line)
        if m:
            out[m.group(1)] = i
    return out


L = markers()


def _available(name: str) -> str | None:
    cmd = INTERPRETERS[name]
    if cmd[0] == "chroot":
        if not (SID / "usr/bin/python3").exists():
            return f"no Debian sid chroot at {SID} (debootstrap --variant=minbase --include=python3 sid {SID})"
        return None
    return None if os.path.exists(cmd[0]) else f"{cmd[0]} not installed"


def _start(name: str):
    cmd = list(INTERPRETERS[name])
    if cmd[0] == "chroot":
        (SID / "stacklens").mkdir(exist_ok=True)
        shutil.copy(TARGET, SID / "stacklens" / "py_calls.py")
        script, shown = "/stacklens/py_calls.py", "/stacklens/py_calls.py"
    else:
        script = shown = str(TARGET)
    p = subprocess.Popen(cmd + [script], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    assert _readline(p) == "ready"
    return p, shown


def _readline(p, timeout=60) -> str:
    try:
        return (read_line(p.stdout, timeout) or "").strip()
    except TimeoutError:
        raise TimeoutError("target did not answer") from None


def libc_of(pid: int) -> str:
    """libc as the target names it (BCC resolves it under /proc/PID/root for pid != -1)."""
    path = next(line.split()[-1] for line in open(f"/proc/{pid}/maps") if "/libc.so" in line)
    root = os.path.realpath(f"/proc/{pid}/root")
    return path[len(root):] if root != "/" and path.startswith(root + "/") else path


@dataclass
class Run:
    name: str
    file: str
    reader: object
    events: list  # (tid, RawPyStack, frames)
    py_tids: set


def run_scenario(name: str, *, thread_map: bool = False) -> Run:
    from bcc import BPF

    from stacklens.pystacks.python_process import PythonStackReader

    p, shown = _start(name)
    try:
        reader = PythonStackReader(p.pid, max_depth=MAX_DEPTH, force_map=thread_map)
        flags = reader.cflags() + (["-DPT_THREAD_MAP"] if thread_map else [])
        b = BPF(src_file=str(PROGRAM).encode(), cflags=flags)
        b.attach_uprobe(name=libc_of(p.pid).encode(), sym=b"getpid", fn_name=b"pt_probe",
                        pid=p.pid)
        if thread_map:
            reader.populate(b)
        st = reader.struct_type()

        class Ev(ct.Structure):
            _fields_ = [("tid", ct.c_uint32), ("pad", ct.c_uint32), ("ktime", ct.c_uint64),
                        ("st", st)]

        raw = []

        def cb(_ctx, data, _size):
            e = ct.cast(data, ct.POINTER(Ev)).contents
            raw.append((e.tid, RawPyStack.from_struct(e.st)))

        b[b"pt_events"].open_ring_buffer(cb)
        p.stdin.write("go\n")
        p.stdin.flush()
        assert _readline(p) == "done"
        b.ring_buffer_poll(500)
        drops = sum(b[b"pt_counts"][ct.c_int(1)])
        assert drops == 0
        py_tids = {int(t) for t in os.listdir(f"/proc/{p.pid}/task")}
        events = [(tid, r, reader.symbolize(r)) for tid, r in raw]
        b.cleanup()
        return Run(name, shown, reader, events, py_tids)
    finally:
        p.kill()
        p.wait()


@pytest.fixture(scope="module", params=list(INTERPRETERS))
def run(request, bpf_ok) -> Run:
    why = _available(request.param)
    if why:
        pytest.skip(why)
    return run_scenario(request.param)


def py(run: Run, func: str, marker: str) -> Frame:
    return Frame.python(run.file, func, L[marker])


def count_exact(run: Run, path: tuple) -> int:
    return sum(1 for _, _, fr in run.events if fr == path)


def count_suffix(run: Run, suffix: tuple) -> list:
    return [fr for _, _, fr in run.events if fr[-len(suffix):] == suffix]


def test_main_thread_paths_exact(run: Run):
    mod = py(run, "<module>", "module")
    abc = (mod, py(run, "main", "main_a"), py(run, "a", "a"), py(run, "b", "b"), py(run, "c", "c"))
    xy = (mod, py(run, "main", "main_x"), py(run, "x", "x"), py(run, "y", "y"))
    assert count_exact(run, abc) == COUNTS["abc"]
    assert count_exact(run, xy) == COUNTS["xy"]


def test_threads_before_and_after_attach(run: Run):
    late = count_suffix(run, (py(run, "worker", "worker"), py(run, "t1", "t1"), py(run, "t2", "t2")))
    pre = count_suffix(run, (py(run, "pre_thread", "pre"), py(run, "p2", "p2")))
    assert len(late) == COUNTS["thread"]
    assert len(pre) == COUNTS["pre"]
    for fr in late + pre:  # rooted in threading.py's bootstrap, nothing invented above it
        assert fr[0].file.endswith("threading.py") and "bootstrap" in fr[0].name


def test_generator(run: Run):
    path = (py(run, "<module>", "module"), py(run, "main", "main_gen"), py(run, "gen", "gen"))
    assert count_exact(run, path) == COUNTS["gen"]


def test_asyncio_coroutines(run: Run):
    got = count_suffix(run, (py(run, "co_outer", "co_outer"), py(run, "co_inner", "co_inner")))
    assert len(got) == COUNTS["coro"]
    for fr in got:
        assert fr[:2] == (py(run, "<module>", "module"), py(run, "main", "main_coro"))
        assert all(f.kind == "python" for f in fr)


def test_recursion_truncated_and_marked(run: Run):
    got = [e for e in run.events if e[1].truncated]
    assert len(got) == COUNTS["rec"]
    for _, raw, fr in got:
        assert len(raw.frames) == MAX_DEPTH
        assert fr[0] == Frame.other("[truncated]")
        assert fr[-1] == py(run, "rec", "rec_leaf")
        assert set(fr[1:-1]) == {py(run, "rec", "rec")}


def test_c_calling_back_into_python(run: Run):
    path = (py(run, "<module>", "module"), py(run, "main", "main_sorter"),
            py(run, "sorter", "sorter"), py(run, "cmp", "cmp"))
    hits = [(raw, fr) for _, raw, fr in run.events if fr == path]
    assert len(hits) == COUNTS["qsort"]
    if run.reader.layout.version < (3, 11):
        return  # 3.10 frames carry no eval-loop entry marker
    for raw, _ in hits:
        entry = run.reader.symbolizer.entry_flags(raw)
        # qsort (C) re-entered the eval loop for cmp: cmp starts an eval-loop invocation
        assert entry[-1] is True and entry[-2] is False


def test_non_python_threads_get_no_frames(run: Run):
    empty = [(tid, raw) for tid, raw, fr in run.events if not fr]
    assert len(empty) == COUNTS["native"]
    assert all(raw.status == SL_PY_NO_TSTATE for _, raw in empty)


def test_no_wrong_frames(run: Run):
    """Anything else the interpreter did (asyncio setup calling getpid …) is a clean stack."""
    for _, raw, fr in run.events:
        if not fr:
            continue
        assert raw.status == SL_PY_OK
        for f in fr:
            if f.kind == "other":
                assert f == Frame.other("[truncated]")
                continue
            assert f.kind == "python" and f.name and f.line > 0
            assert f.file.endswith(".py") or f.file.startswith("<")
        assert fr[0] in (py(run, "<module>", "module"), Frame.other("[truncated]")) \
            or fr[0].file.endswith("threading.py")


def test_symbolization_cache(run: Run):
    s = run.reader.symbolizer.stats
    assert s.stale == 0 and s.errors == 0
    assert s.hits > s.misses


@pytest.mark.parametrize("name", ["pyenv-3.11", "pyenv-3.13"])
def test_thread_map_mode(bpf_ok, name):
    """Fallback without TLS: user space fills tid -> tstate. Threads alive at populate() get
    exact stacks; a thread started later has none until refresh_threads() (never wrong ones)."""
    why = _available(name)
    if why:
        pytest.skip(why)
    r = run_scenario(name, thread_map=True)
    assert r.reader.mode == "map"
    mod = py(r, "<module>", "module")
    abc = (mod, py(r, "main", "main_a"), py(r, "a", "a"), py(r, "b", "b"), py(r, "c", "c"))
    assert count_exact(r, abc) == COUNTS["abc"]
    assert len(count_suffix(r, (py(r, "pre_thread", "pre"), py(r, "p2", "p2")))) == COUNTS["pre"]
    assert not count_suffix(r, (py(r, "t1", "t1"), py(r, "t2", "t2")))  # late thread: unknown


def test_ctypes_mirror_matches_c(tmp_path):
    """struct sl_pystack / sl_pyframe in pystack.h == the ctypes mirror in pystacks/pysym.py."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler")
    src = tmp_path / "m.c"
    src.write_text(
        "#include <stdio.h>\n#include <stddef.h>\n#include <stdint.h>\n"
        "typedef uint64_t u64; typedef uint32_t u32; typedef uint16_t u16; typedef uint8_t u8;\n"
        "typedef int32_t s32; struct pt_regs; struct task_struct;\n"
        "#define SL_PY_TGID 1\n#define SL_PY_FRAME_STYLE 311\n#define SL_PY_MAX_DEPTH 48\n"
        "#define STACKLENS_PYSTACK_ONLY_TYPES\n"
        "#include \"pystack_types.h\"\n"
        "int main(void){printf(\"%zu %zu %zu %zu %zu\\n\", sizeof(struct sl_pyframe),"
        " sizeof(struct sl_pystack), offsetof(struct sl_pystack, tstate),"
        " offsetof(struct sl_pystack, frames), offsetof(struct sl_pyframe, offset));}\n")
    # only the type definitions of pystack.h (up to the first function)
    text = (ROOT / "bpf/programs/pystack.h").read_text()
    types = text[text.index("struct sl_pyframe {"):text.index("/* ---- per-process parameters")]
    (tmp_path / "pystack_types.h").write_text(types)
    subprocess.run([cc, "-o", str(tmp_path / "m"), str(src), f"-I{tmp_path}"], check=True)
    got = subprocess.run([str(tmp_path / "m")], capture_output=True, text=True).stdout.split()
    st = sl_pystack_struct(MAX_DEPTH)
    assert [int(x) for x in got] == [ct.sizeof(SlPyFrame), ct.sizeof(st), st.tstate.offset,
                                     st.frames.offset, SlPyFrame.offset.offset]


def test_capture_hook_with_maps(bpf_ok):
    """-DSL_PYSTACK_MAPS: SL_CAPTURE_PYSTACK(ctx, ev) (the stacklens.h hook) stores stacks in
    `sl_py_stacks` by id. BCC rewrites map calls only in the main text, so the loader inlines
    pystack.h (here: prepended)."""
    from bcc import BPF

    from stacklens.pystacks.python_process import PythonStackReader

    name = "pyenv-3.11"
    if _available(name):
        pytest.skip(_available(name))
    header = (ROOT / "bpf/programs/pystack.h").read_text()
    text = ("#include <uapi/linux/ptrace.h>\n#define SL_C_PY_ERR 9\n"
            "BPF_PERCPU_ARRAY(counters, u64, 16);\n"
            "static __always_inline void sl_count(u32 i) { u64 *c = counters.lookup(&i); "
            "if (c) (*c)++; }\n" + header +
            "\nstruct ev_t { u64 py_stack_id; };\nBPF_HASH(ids, u64, u64, 4096);\n"
            "int probe(struct pt_regs *ctx) {\n  struct ev_t ev = {};\n"
            "  SL_CAPTURE_PYSTACK(ctx, &ev);\n  u64 one = 1;\n"
            "  u64 *c = ids.lookup(&ev.py_stack_id);\n"
            "  if (c) (*c)++; else ids.update(&ev.py_stack_id, &one);\n  return 0;\n}\n")
    p, shown = _start(name)
    try:
        r = PythonStackReader(p.pid, max_depth=MAX_DEPTH)
        b = BPF(text=text, cflags=r.cflags() + ["-DSL_PYSTACK_MAPS"])
        b.attach_uprobe(name=libc_of(p.pid).encode(), sym=b"getpid", fn_name=b"probe",
                        pid=p.pid)
        p.stdin.write("go\n")
        p.stdin.flush()
        assert _readline(p) == "done"
        stacks = b[b"sl_py_stacks"]
        got = Counter()
        for k, v in b[b"ids"].items():
            if k.value == 0:
                got[()] += v.value
                continue
            raw = RawPyStack.from_bytes(bytes(stacks[k]), MAX_DEPTH)
            got[r.symbolize(raw)] += v.value
        b.cleanup()
    finally:
        p.kill()
        p.wait()
    mod = Frame.python(shown, "<module>", L["module"])
    abc = (mod, Frame.python(shown, "main", L["main_a"]), Frame.python(shown, "a", L["a"]),
           Frame.python(shown, "b", L["b"]), Frame.python(shown, "c", L["c"]))
    assert got[abc] == COUNTS["abc"]
    assert got[()] == COUNTS["native"]
