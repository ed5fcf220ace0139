"""Issue 30 acceptance 2 on a real target (root + eBPF): stacklens' folded stacks of
tests/targets/stages.py name frames as py-spy's raw output (`py-spy record --format raw`) of the
same process over the same time does, `function (file:line)`, so that the two files compare line
by line: the same top functions, by the same frame names, and py-spy's hottest stacks are lines
of ours, word for word.

The target runs from a copy in a folder that is not a Python package: py-spy keeps the package
folders above a file (it looks for __init__.py files, and tests/targets is a package of the
checkout), which stacklens' renderers, doing no I/O, cannot (docs/profile-format.md, "Frame
names"). Both profilers run at once (py-spy --nonblocking: the target is never stopped; --gil: a
thread waiting for the GIL is not counted), until stacklens has MIN_SAMPLES.
"""

from __future__ import annotations

import re
import shutil
from collections import Counter

from stacklens.cct import diff
from stacklens.daemon.session import ProcessSession
from stacklens.render.folded import to_folded

from tests.bpf.conftest import TARGETS
from tests.bpf.pyspy import py_spy, record_beside

RATE = 499          # Hz, both profilers
MIN_SAMPLES = 1500  # stacklens' (py-spy, at wall time, has more)
STAGES = ["encoder", "preprocess", "head"]   # 50%, 30%, 20% of the main thread's work
# a Python frame in py-spy's raw format: `function (file:line)`
PYTHON_FRAME = re.compile(r"^(?P<function>.+) \((?P<file>.+):(?P<line>[0-9]+)\)$")


def stacks_of(folded: str) -> Counter:
    """{stack: count} of a folded file (py-spy's raw format or ours)."""
    out: Counter = Counter()
    for line in folded.splitlines():
        stack, _, n = line.rpartition(" ")
        out[stack] += int(n)
    return out


def innermost(stacks: Counter) -> Counter:
    """{innermost Python frame: count}: native frames below it (libc, in ours) left out."""
    out: Counter = Counter()
    for stack, n in stacks.items():
        python = [f for f in stack.split(";") if PYTHON_FRAME.match(f)]
        if python:
            out[python[-1]] += n
    return out


def by_function(frames: Counter) -> Counter:
    out: Counter = Counter()
    for frame, n in frames.items():
        out[PYTHON_FRAME.match(frame)["function"]] += n
    return out


def test_folded_names_frames_as_py_spy_does(bpf_available, start_target, tmp_path):
    pyspy = py_spy()
    script = tmp_path / "stages.py"
    shutil.copy(TARGETS / "stages.py", script)
    t = start_target(str(script))
    session = ProcessSession(t.pid, agent=False, cpu_hz=RATE, ops=False)
    raw = tmp_path / "pyspy.txt"
    try:
        session.start(window=True)
        before, after = record_beside(pyspy, session, raw, rate=RATE, min_samples=MIN_SAMPLES, timeout_s=120)
    finally:
        session.stop()
    ours_text = to_folded(diff(after, before), "cpu_samples")
    ours, theirs = stacks_of(ours_text), stacks_of(raw.read_text())
    got = {"stacklens": ours.most_common(8), "py-spy": theirs.most_common(8)}
    print(f"\n{got}")
    assert sum(ours.values()) >= MIN_SAMPLES * 0.9 and sum(theirs.values()) >= MIN_SAMPLES / 2, got

    # the same top functions, by the same name
    our_frames, their_frames = innermost(ours), innermost(theirs)
    assert [f for f, _ in by_function(our_frames).most_common(3)] == STAGES, got
    assert [f for f, _ in by_function(their_frames).most_common(3)] == STAGES, got
    # …and lines: each stage's innermost frames with a tenth of its samples or more, word for word
    # (`encoder (stages.py:44)`; the loop's two lines take ~75% and ~25%)
    for stage in STAGES:
        def hot(frames: Counter) -> set[str]:
            mine = {f: n for f, n in frames.items() if PYTHON_FRAME.match(f)["function"] == stage}
            return {f for f, n in mine.items() if n >= 0.1 * sum(mine.values())}
        assert hot(our_frames) == hot(their_frames) and hot(our_frames), (stage, got)
        assert all(PYTHON_FRAME.match(f)["file"] == "stages.py" for f in hot(our_frames)), got

    # py-spy's hottest stacks (each 3% of its samples or more: the stages' lines, under
    # `<module> (stages.py:108);timed (stages.py:84)`) are lines of ours, and ours of its
    def top(stacks: Counter) -> set[str]:
        total = sum(stacks.values())
        return {s for s, n in stacks.items() if n >= 0.03 * total and s.rpartition(";")[2].split(" (")[0] in STAGES}
    assert len(top(theirs)) >= 3, got
    assert top(theirs) <= set(ours) and top(ours) <= set(theirs), (top(theirs) ^ top(ours), got)
    # every line of ours is a folded line: `frame;frame COUNT`, no blank in a count, no ';' lost
    assert all(re.fullmatch(r"[^\n]+ [0-9]+", ln) for ln in ours_text.splitlines())
