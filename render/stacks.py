"""What the stack renderers (folded, pprof, speedscope) share: every node's path of frames, how a
frame is named (`frame_name`: one rule for the three), the check that a metric was measured, the
unit of a metric and the CPU sampler's period.

Pure, no privilege, no I/O. Metrics listed in `snapshot.unavailable` were not measured: the
one-metric renderers refuse them, because showing them as 0 would claim a measurement that never
happened.
"""

from __future__ import annotations

import re
from typing import NamedTuple

from stacklens.cct.frames import ROOT, Frame
from stacklens.cct.metrics import BYTES, COUNT, TIME, kind_of
from stacklens.cct.snapshot import Snapshot
from stacklens.errors import InputError

_UNIT = {TIME: "nanoseconds", BYTES: "bytes", COUNT: "count"}
# the standard library's folder: lib/python3.11 (lib64, a free-threaded build's python3.13t)
_STDLIB_DIR = re.compile(r"python[0-9]+\.[0-9]+t?")


def unit_of(metric: str) -> str:
    """pprof unit of a metric (cct/metrics.py): nanoseconds, bytes or count."""
    return _UNIT[kind_of(metric)]


def cpu_period_ns(snap: Snapshot) -> int:
    """Nanoseconds per CPU sample at the profile's sampling rate (meta["cpu_hz"]), 0 when unknown:
    what pprof's `cpu` sample type and speedscope's time units weigh a sample by."""
    meta = snap.meta if isinstance(snap.meta, dict) else {}
    hz = meta.get("cpu_hz")
    return 1_000_000_000 // hz if isinstance(hz, int) and not isinstance(hz, bool) and hz > 0 else 0


def check_measured(snap: Snapshot, metric: str) -> None:
    """InputError unless `metric` is one of the snapshot's metrics and was measured."""
    if metric not in snap.metrics:
        raise InputError(f"unknown metric {metric!r}; this profile has {', '.join(snap.metrics)}")
    if metric in snap.unavailable:
        measured = [m for m in snap.metrics if m not in snap.unavailable]
        raise InputError(
            f"metric {metric!r} was not measured in this profile; choose one of {', '.join(measured)}"
        )


def node_paths(snap: Snapshot) -> list[tuple[Frame, ...]]:
    """Path of every node, built parent-first in one pass; the root's is (ROOT,) so that a
    value recorded on the root itself still appears in the exports."""
    paths: list[tuple[Frame, ...]] = [(ROOT,)]
    for node in range(1, snap.node_count):
        parent = snap.parent(node)
        paths.append((paths[parent] if parent else ()) + (snap.frame_of(node),))
    return paths


def display_path(file: str) -> str:
    """A Python file as profilers show it, the same on every machine and virtualenv: relative to
    site-packages / dist-packages (`torch/nn/modules/linear.py`), else to the standard library's
    folder (`concurrent/futures/thread.py`), else its name (`train.py` for /srv/job/train.py); a
    pseudo-file (`<string>`, `<frozen importlib._bootstrap>`) as it is. py-spy shortens the same
    way where a script's folder is not a package (it also looks for __init__.py files, which a
    pure renderer cannot)."""
    if file.startswith("<") or "/" not in file:
        return file
    parts = file.split("/")
    for anchor in ("site-packages", "dist-packages"):
        if anchor in parts:
            return "/".join(parts[len(parts) - parts[::-1].index(anchor):])
    for i in range(len(parts) - 2, 0, -1):
        if _STDLIB_DIR.fullmatch(parts[i]) and parts[i - 1] in ("lib", "lib64"):
            return "/".join(parts[i + 1:])
    return parts[-1]


def module_of_path(path: str) -> str:
    """The dotted module of a display path (`torch.nn.modules.linear`, `train`; a package's
    __init__.py is the package); a path that is not a .py file as it is."""
    if not path.endswith(".py"):
        return path
    parts = [p for p in path[:-3].split("/") if p]
    if len(parts) > 1 and parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


class FrameName(NamedTuple):
    """A frame as the stack renderers name it (`frame_name`)."""

    function: str   # what pprof groups by, speedscope's name: `module.qualname` for Python
    local: str      # the name within its file, as py-spy writes it: a Python function's qualname
    file: str       # display_path of a Python file, the name of a native frame's library, else ""
    line: int       # a Python frame's line, else 0

    def text(self) -> str:
        """One string, py-spy's (`--format raw`): `local (file:line)`, `local (file)`, `local`."""
        if self.file and self.line:
            return f"{self.local} ({self.file}:{self.line})"
        return f"{self.local} ({self.file})" if self.file else self.local


def frame_name(frame: Frame) -> FrameName:
    """How pprof, folded and speedscope name a frame, one rule for the three.

    A Python function by its module and qualname (`prep.preprocess`, `model.Block.forward`, as Go
    functions are named by package: pprof merges equal names, and the many `forward`s stay
    apart), its file by `display_path` and its line; a native frame by its symbol (`[stripped]`
    where it has none) and its library's file name; an operator, kernel or GPU API call by its
    name; every other kind (backward, module, memcpy, memset, instruction, `[synthetic]`) by its
    label (`backward:AddmmBackward0`, `[other]`)."""
    kind = frame.kind
    if kind == "python":
        path = display_path(frame.file)
        module = module_of_path(path)
        return FrameName(f"{module}.{frame.name}" if module else frame.name, frame.name, path, frame.line)
    if kind == "native":
        lib = frame.file.rsplit("/", 1)[-1]
        return FrameName(frame.name, frame.name, lib, 0)
    if kind in ("op", "kernel", "gpu_api"):
        return FrameName(frame.name, frame.name, "", 0)
    label = frame.label()
    return FrameName(label, label, "", 0)
