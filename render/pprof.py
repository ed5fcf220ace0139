"""pprof's profile.proto, gzip-compressed: what `go tool pprof` and most profile viewers read.

Pure, no privilege, no I/O. Written by hand in the protobuf wire format rather than through
generated code, so there is no generated module to drift from the protobuf runtime; the tests
parse the output back with the profile.proto schema compiled by protoc, and with `go tool pprof`.
Metrics not measured (`snapshot.unavailable`) are left out.
"""

from __future__ import annotations

import gzip
from collections.abc import Iterable, Sequence

from stacklens import __version__
from stacklens.cct.frames import Frame
from stacklens.cct.metrics import CPU_SAMPLES, opening_metric
from stacklens.cct.snapshot import Snapshot
from stacklens.errors import InputError
from stacklens.render.stacks import cpu_period_ns, frame_name, node_paths, unit_of

_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1

# (sample type name, unit, metric column, scale)
SampleType = tuple[str, str, int, int]


def _varint(value: int) -> bytes:
    if value < 0:
        value += 1 << 64  # int64 two's complement, as protobuf encodes negative int64
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _int_field(field: int, value: int) -> bytes:
    """A varint field; proto3 leaves out zero."""
    return _varint(field << 3) + _varint(value) if value else b""


def _bytes_field(field: int, payload: bytes) -> bytes:
    return _varint(field << 3 | 2) + _varint(len(payload)) + payload


def _packed_field(field: int, values: Iterable[int]) -> bytes:
    return _bytes_field(field, b"".join(map(_varint, values)))


class _Strings:
    """pprof's string table: "" is 0, every other string gets the next index at its first use
    (a dict keeps insertion order, which is the index order)."""

    def __init__(self) -> None:
        self.index: dict[str, int] = {"": 0}

    def __call__(self, text: str) -> int:
        idx = self.index.get(text)
        if idx is None:
            idx = self.index[text] = len(self.index)
        return idx

    def label(self, key: str, *, text: str = "", num: int = 0) -> bytes:
        """A Sample.label (field 3): a string or a numeric value under `key`."""
        return _bytes_field(3, _int_field(1, self(key)) + _int_field(2, self(text) if text else 0)
                            + _int_field(3, num))

    def table(self) -> bytes:
        return b"".join(_bytes_field(6, text.encode()) for text in self.index)


def _sample_types(metrics: Sequence[str], period: int) -> list[SampleType]:
    """One per measured metric; CPU samples as `samples/count` and, with a sampling period, also
    as `cpu/nanoseconds`."""
    types: list[SampleType] = []
    for col, m in enumerate(metrics):
        if m == CPU_SAMPLES:
            types.append(("samples", "count", col, 1))
            if period:
                types.append(("cpu", "nanoseconds", col, period))
        else:
            types.append((m, unit_of(m), col, 1))
    return types


class _Samples:
    """The Sample messages of every node with a value, and the Location id of every frame they
    name (one per distinct frame, numbered by first use)."""

    def __init__(self, snap: Snapshot, metrics: list[str], types: list[SampleType], s: _Strings) -> None:
        self.snap, self.metrics, self.types, self.s = snap, metrics, types, s
        meta = snap.meta if isinstance(snap.meta, dict) else {}
        pid = meta.get("pid")
        self.pid_label = s.label("pid", num=pid) if isinstance(pid, int) and not isinstance(pid, bool) and pid > 0 else b""
        self.names = meta.get("threads") if isinstance(meta.get("threads"), dict) else {}
        self.thread_labels: dict[int, bytes] = {}
        self.by_thread = [c for c, m in enumerate(metrics) if m in snap.threaded]
        self.other_threads = self.pid_label + s.label("thread", text="[other threads]") if self.by_thread else b""
        self.location_of: dict[Frame, int] = {}

    def encode(self) -> bytes:
        out = bytearray()
        paths = node_paths(self.snap)
        columns = [self.snap.exclusive_column(m) for m in self.metrics]  # not a call per value
        for node, values in enumerate(zip(*columns)):
            if any(values):
                out += self._of_node(node, paths[node], values)
        return bytes(out)

    def _of_node(self, node: int, path: tuple[Frame, ...], values: Sequence[int]) -> bytes:
        """One sample per thread of the node's breakdown, one for what they leave of the metrics
        counted by thread, one for the metrics not counted by thread: they add up to `values`."""
        ids = []
        for frame in reversed(path):  # pprof wants the leaf first
            loc = self.location_of.get(frame)
            if loc is None:
                loc = self.location_of[frame] = len(self.location_of) + 1
            ids.append(loc)
        stack = _packed_field(1, ids)
        rest = list(values)
        threads: dict[int, list[int]] = {}
        for c in self.by_thread:
            for tid, count in self.snap.threads(node, self.metrics[c]):
                threads.setdefault(tid, [0] * len(self.metrics))[c] = count
                rest[c] -= count
        out = bytearray()
        for tid, row in threads.items():
            out += self._sample(node, stack, row, self._thread_labels(tid))
        counted = set(self.by_thread)
        out += self._sample(node, stack, [v if c in counted else 0 for c, v in enumerate(rest)], self.other_threads)
        out += self._sample(node, stack, [0 if c in counted else v for c, v in enumerate(rest)], self.pid_label)
        return bytes(out)

    def _thread_labels(self, tid: int) -> bytes:
        labels = self.thread_labels.get(tid)
        if labels is None:
            name = self.names.get(str(tid))
            labels = self.thread_labels[tid] = (
                self.pid_label + self.s.label("tid", num=tid)
                + (self.s.label("thread", text=name) if isinstance(name, str) and name else b""))
        return labels

    def _sample(self, node: int, stack: bytes, values: Sequence[int], labels: bytes) -> bytes:
        row = [values[c] * scale for (_n, _u, c, scale) in self.types]
        if not any(row):
            return b""
        if not all(_INT64_MIN <= v <= _INT64_MAX for v in row):
            raise InputError(f"a value at {self.snap.path(node)} does not fit pprof's 64-bit integers")
        return _bytes_field(2, stack + _packed_field(2, row) + labels)


def _locations_and_functions(location_of: dict[Frame, int], s: _Strings) -> bytes:
    """One pseudo-mapping that says symbols are already resolved (so readers never try to
    symbolize the absent addresses), then a Location and a Function per frame: Function.name
    is the frame's function (render/stacks.py `frame_name`, as folded and speedscope name it),
    system_name the frame's full label, filename its file (Python) or library (native), whole, so
    that `-list` finds the source; the Location's line its line."""
    functions = bytearray()
    locations = bytearray()
    for frame, loc in location_of.items():
        function = (_int_field(1, loc) + _int_field(2, s(frame_name(frame).function))
                    + _int_field(3, s(frame.label())) + _int_field(4, s(frame.file)))
        functions += _bytes_field(5, function)
        line = _int_field(1, loc) + _int_field(2, frame.line)
        locations += _bytes_field(4, _int_field(1, loc) + _int_field(2, 1) + _bytes_field(4, line))
    mapping = _int_field(1, 1) + _int_field(5, s("stacklens")) + b"".join(_int_field(f, 1) for f in (7, 8, 9))
    return _bytes_field(3, mapping) + bytes(locations) + bytes(functions)


def to_pprof(snap: Snapshot) -> bytes:
    """gzip-compressed profile.proto, by pprof's conventions: each measured metric is one sample
    type with its unit; CPU samples as `samples/count` and, when the sampling rate is known
    (meta["cpu_hz"]), also `cpu/nanoseconds` (samples × period), the period type and period;
    `time_nanos` / `duration_nanos` from the profile's start and window when known.

    One Function and one Location per distinct frame: Function.name is the function, named as
    folded and speedscope name it (render/stacks.py `frame_name`: `module.qualname` for Python),
    system_name the frame's full label, filename its file (Python) or library (native); the
    Location's line its line. The default sample type is GPU time where it
    was measured, else CPU.

    Samples: per node, one for each thread of its breakdown (`Snapshot.threads`: CPU and Python
    samples), labelled `pid`, `tid` (numeric) and `thread` (its name, meta["threads"], when
    known), so `-tagfocus=thread=NAME` keeps that thread's samples; one labelled
    `thread=[other threads]` for what the listed threads leave of those metrics; one with only
    `pid` for the metrics not counted by thread (GPU time, launches, bytes...). Values add up to
    the node's exclusive values.
    """
    s = _Strings()
    metrics = [m for m in snap.metrics if m not in snap.unavailable]
    meta = snap.meta if isinstance(snap.meta, dict) else {}
    period = cpu_period_ns(snap)
    types = _sample_types(metrics, period)
    out = bytearray()
    for name, unit, _col, _scale in types:
        out += _bytes_field(1, _int_field(1, s(name)) + _int_field(2, s(unit)))
    samples = _Samples(snap, metrics, types, s)
    out += samples.encode()
    out += _locations_and_functions(samples.location_of, s)

    comments = [s(f"stacklens {__version__}")]
    if snap.unavailable:
        comments.append(s("unavailable (not measured): " + ", ".join(sorted(snap.unavailable))))
    if snap.folded_nodes:
        comments.append(s(f"folded_nodes: {snap.folded_nodes}"))
    # pprof shows this one first: what views open on (GPU time where measured); CPU as time
    opening = opening_metric(snap) if metrics else ""
    of_opening = [t[0] for t in types if metrics[t[2]] == opening]
    default = s(of_opening[-1] if of_opening else "")
    window = meta.get("window") or {}
    start_unix = meta.get("start_unix_ns")
    period_type = _bytes_field(11, _int_field(1, s("cpu")) + _int_field(2, s("nanoseconds"))) if period else b""

    out += s.table()  # complete by now
    if isinstance(start_unix, int):
        out += _int_field(9, start_unix)
    if isinstance(window.get("seconds"), (int, float)):
        out += _int_field(10, int(window["seconds"] * 1e9))
    out += period_type + _int_field(12, period)
    out += _packed_field(13, comments)
    out += _int_field(14, default)
    return gzip.compress(bytes(out), mtime=0)
