"""Snapshot exports: folded stacks, pprof, speedscope, and stacklens' own JSON (save / load).

Pure functions over a `Snapshot`; only `save` and `load` touch the file system. Formats are
described in docs/profile-format.md. Metrics listed in `snapshot.unavailable` were not measured:
they are left out of pprof, recorded as such in JSON, and refused by the one-metric exports,
because showing them as 0 would claim a measurement that never happened.

pprof is written by hand in the protobuf wire format rather than through generated code, so
there is no generated module to drift from the protobuf runtime; the tests parse the output back
with the profile.proto schema compiled by protoc, and with `go tool pprof`.
"""

from __future__ import annotations

import gzip
import json
import os
import zlib
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from .. import __version__
from ..errors import InputError
from .frames import KINDS, ROOT, Frame
from .snapshot import Snapshot

JSON_FORMAT = "stacklens.profile"
JSON_VERSION = 1
_HINT = "pass a profile written by stacklens (JSON, .json or .json.gz)"


def unit_of(metric: str) -> str:
    """pprof unit of a metric, from its name: *_ns are nanoseconds, *_bytes bytes, else count."""
    if metric.endswith("_ns"):
        return "nanoseconds"
    if metric.endswith("_bytes"):
        return "bytes"
    return "count"


def _measured(snap: Snapshot, metric: str) -> None:
    if metric not in snap.metrics:
        raise InputError(f"unknown metric {metric!r}; this profile has {', '.join(snap.metrics)}")
    if metric in snap.unavailable:
        measured = [m for m in snap.metrics if m not in snap.unavailable]
        raise InputError(
            f"metric {metric!r} was not measured in this profile; choose one of {', '.join(measured)}"
        )


def _node_paths(snap: Snapshot) -> list[tuple[Frame, ...]]:
    """Path of every node, built parent-first in one pass; the root's is (ROOT,) so that a
    value recorded on the root itself still appears in the exports."""
    paths: list[tuple[Frame, ...]] = [(ROOT,)]
    for node in range(1, snap.node_count):
        parent = snap.parent(node)
        paths.append((paths[parent] if parent else ()) + (snap.frame_of(node),))
    return paths


# -- folded ----------------------------------------------------------------------------------


def _folded_label(frame: Frame) -> str:
    # ';' separates frames and a newline ends the record in the folded format.
    return frame.label().replace(";", "%3B").replace("\n", "%0A")


def to_folded(snap: Snapshot, metric: str, inclusive: bool = False) -> str:
    """Folded stacks, one `label;label;... VALUE` line per node with a non-zero value, sorted.

    Exclusive values (the default) are what flame graph tools expect: they add the lines up
    themselves. `inclusive=True` writes each node's inclusive value instead, for grepping.
    """
    _measured(snap, metric)
    value_of = snap.inclusive if inclusive else snap.exclusive
    labels: list[str] = [_folded_label(ROOT)]
    lines = []
    for node in range(snap.node_count):
        if node:
            parent = snap.parent(node)
            own = _folded_label(snap.frame_of(node))
            labels.append(f"{labels[parent]};{own}" if parent else own)
        value = value_of(node, metric)
        if value and (node or not inclusive):
            lines.append(f"{labels[node]} {value}")
    lines.sort()
    return "".join(line + "\n" for line in lines)


# -- pprof -----------------------------------------------------------------------------------


_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1


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


def to_pprof(snap: Snapshot) -> bytes:
    """gzip-compressed profile.proto; each measured metric is one sample type.

    One Function and one Location per distinct frame (Function name = frame label, so distinct
    frames never merge in pprof), one Sample per node with a non-zero exclusive value.
    """
    strings: dict[str, int] = {"": 0}

    def s(text: str) -> int:
        idx = strings.get(text)
        if idx is None:
            idx = strings[text] = len(strings)
        return idx

    metrics = [m for m in snap.metrics if m not in snap.unavailable]
    out = bytearray()
    for m in metrics:
        out += _bytes_field(1, _int_field(1, s(m)) + _int_field(2, s(unit_of(m))))

    paths = _node_paths(snap)
    location_of: dict[Frame, int] = {}
    columns = [snap._excl[m] for m in metrics]  # one tuple per metric, not a call per value
    for node, values in enumerate(zip(*columns)):
        if any(values):
            if not all(_INT64_MIN <= v <= _INT64_MAX for v in values):
                raise InputError(f"a value at {snap.path(node)} does not fit pprof's 64-bit integers")
            stack = []
            for frame in reversed(paths[node]):  # pprof wants the leaf first
                loc = location_of.get(frame)
                if loc is None:
                    loc = location_of[frame] = len(location_of) + 1
                stack.append(loc)
            out += _bytes_field(2, _packed_field(1, stack) + _packed_field(2, values))

    functions = bytearray()
    locations = bytearray()
    for frame, loc in location_of.items():
        label = s(frame.label())
        function = _int_field(1, loc) + _int_field(2, label) + _int_field(3, label) + _int_field(4, s(frame.file))
        functions += _bytes_field(5, function)
        line = _int_field(1, loc) + _int_field(2, frame.line)
        locations += _bytes_field(4, _int_field(1, loc) + _int_field(2, 1) + _bytes_field(4, line))

    # One pseudo-mapping that says symbols are already resolved, so readers never try to
    # symbolize the (absent) addresses.
    mapping = _int_field(1, 1) + _int_field(5, s("stacklens")) + b"".join(_int_field(f, 1) for f in (7, 8, 9))
    out += _bytes_field(3, mapping)
    out += locations
    out += functions

    comments = [s(f"stacklens {__version__}")]
    if snap.unavailable:
        comments.append(s("unavailable (not measured): " + ", ".join(sorted(snap.unavailable))))
    if snap.folded_nodes:
        comments.append(s(f"folded_nodes: {snap.folded_nodes}"))
    # pprof shows this one first: the first measured metric that has data.
    default = s(next((m for m in metrics if snap.total(m)), metrics[0] if metrics else ""))

    for text in strings:  # dicts keep insertion order, which is the index order
        out += _bytes_field(6, text.encode())
    out += _packed_field(13, comments)
    out += _int_field(14, default)
    return gzip.compress(bytes(out), mtime=0)


# -- speedscope ------------------------------------------------------------------------------

_SPEEDSCOPE_UNIT = {"nanoseconds": "nanoseconds", "bytes": "bytes", "count": "none"}


def to_speedscope(snap: Snapshot, metric: str) -> dict[str, Any]:
    """A speedscope file (https://www.speedscope.app/file-format-schema.json) with one sampled
    profile: one sample per node with a non-zero exclusive value, weighted by that value."""
    _measured(snap, metric)
    frame_index: dict[Frame, int] = {}
    frames: list[dict[str, Any]] = []
    samples: list[list[int]] = []
    weights: list[int] = []
    paths = _node_paths(snap)
    for path in paths:
        frame = path[-1]
        if frame not in frame_index:
            frame_index[frame] = len(frames)
            entry: dict[str, Any] = {"name": frame.label()}
            if frame.file:
                entry["file"] = frame.file
            if frame.line:
                entry["line"] = frame.line
            frames.append(entry)
    for node in range(snap.node_count):
        value = snap.exclusive(node, metric)
        if value:
            samples.append([frame_index[f] for f in paths[node]])
            weights.append(value)
    name = str(snap.meta.get("name", "stacklens"))
    return {
        "$schema": "https://www.speedscope.app/file-format-schema.json",
        "shared": {"frames": frames},
        "profiles": [
            {
                "type": "sampled",
                "name": f"{name} {metric}",
                "unit": _SPEEDSCOPE_UNIT[unit_of(metric)],
                "startValue": 0,
                "endValue": sum(weights),
                "samples": samples,
                "weights": weights,
            }
        ],
        "name": name,
        "activeProfileIndex": 0,
        "exporter": f"stacklens {__version__}",
    }


# -- stacklens JSON --------------------------------------------------------------------------


def to_json(snap: Snapshot) -> dict[str, Any]:
    """The documented, versioned JSON form (docs/profile-format.md); `from_json` reads it back."""
    frame_index: dict[Frame, int] = {}
    frames: list[list[Any]] = []
    nodes: list[list[Any]] = []
    for node, row in enumerate(zip(*(snap._excl[m] for m in snap.metrics))):
        values = {m: v for m, v in zip(snap.metrics, row) if v}
        if node == 0:
            nodes.append([-1, -1, values])
            continue
        frame = snap.frame_of(node)
        idx = frame_index.get(frame)
        if idx is None:
            idx = frame_index[frame] = len(frames)
            frames.append(list(frame))
        nodes.append([snap.parent(node), idx, values])
    return {
        "format": JSON_FORMAT,
        "version": JSON_VERSION,
        "metrics": list(snap.metrics),
        "unavailable": sorted(snap.unavailable),
        "folded_nodes": snap.folded_nodes,
        "meta": snap.meta,
        "frames": frames,
        "nodes": nodes,
    }


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def from_json(obj: Any) -> Snapshot:
    """Read the JSON form; raises InputError saying what is wrong with anything else."""

    def bad(what: str) -> InputError:
        return InputError(f"not a valid stacklens profile: {what}; {_HINT}")

    if not isinstance(obj, dict) or obj.get("format") != JSON_FORMAT:
        raise bad(f"expected a JSON object with \"format\": \"{JSON_FORMAT}\"")
    version = obj.get("version")
    if version != JSON_VERSION:
        if _is_int(version) and version > JSON_VERSION:
            raise InputError(
                f"profile format version {version} is newer than this stacklens reads "
                f"({JSON_VERSION}); upgrade stacklens"
            )
        raise bad(f"unsupported version {version!r}")
    metrics = obj.get("metrics")
    if not isinstance(metrics, list) or not metrics or not all(isinstance(m, str) for m in metrics):
        raise bad("\"metrics\" must be a non-empty list of names")
    if len(set(metrics)) != len(metrics):
        raise bad("\"metrics\" has duplicates")
    unavailable = obj.get("unavailable", [])
    if not isinstance(unavailable, list) or not all(m in metrics for m in unavailable):
        raise bad("\"unavailable\" must list some of the metrics")
    folded = obj.get("folded_nodes", 0)
    meta = obj.get("meta", {})
    if not _is_int(folded) or not isinstance(meta, dict):
        raise bad("\"folded_nodes\" must be an integer and \"meta\" an object")

    raw_frames = obj.get("frames", [])
    if not isinstance(raw_frames, list):
        raise bad("\"frames\" must be a list")
    frames: list[Frame] = []
    for i, raw in enumerate(raw_frames):
        if (
            not isinstance(raw, list)
            or len(raw) != 4
            or raw[0] not in KINDS
            or not all(isinstance(x, str) for x in raw[1:3])
            or not _is_int(raw[3])
        ):
            raise bad(f"frame {i} must be [kind, name, file, line] with kind one of {', '.join(KINDS)}")
        frames.append(Frame(*raw))

    raw_nodes = obj.get("nodes")
    if not isinstance(raw_nodes, list) or not raw_nodes:
        raise bad("\"nodes\" must be a non-empty list")
    node_frames: list[Frame] = []
    parents: list[int] = []
    columns: dict[str, list[int]] = {m: [0] * len(raw_nodes) for m in metrics}
    seen: set[tuple[int, int]] = set()
    for i, raw in enumerate(raw_nodes):
        if not isinstance(raw, list) or len(raw) != 3 or not isinstance(raw[2], dict):
            raise bad(f"node {i} must be [parent, frame, {{metric: value}}]")
        parent, frame, values = raw
        if i == 0:
            if parent != -1 or frame != -1:
                raise bad("node 0 must be the root, [-1, -1, {...}]")
            node_frames.append(ROOT)
        else:
            if not _is_int(parent) or not 0 <= parent < i:
                raise bad(f"node {i} has parent {parent!r}; parents must come before their children")
            if not _is_int(frame) or not 0 <= frame < len(frames):
                raise bad(f"node {i} refers to frame {frame!r}, which is not in \"frames\"")
            if (parent, frame) in seen:
                raise bad(f"node {i} repeats a sibling's frame")
            seen.add((parent, frame))
            node_frames.append(frames[frame])
        parents.append(parent)
        for metric, value in values.items():
            if metric not in columns or not _is_int(value):
                raise bad(f"node {i} has {metric!r}: {value!r}; values must be integers of listed metrics")
            columns[metric][i] = value
    return Snapshot(
        metrics, node_frames, parents, columns, unavailable=unavailable, folded_nodes=folded, meta=meta
    )


_SAVE_FORMATS = ("json", "json.gz")


def save(snap: Snapshot, path: str | os.PathLike[str], fmt: str | None = None) -> None:
    """Write the JSON form, gzip-compressed for `fmt="json.gz"` (default: from the suffix).

    Writes a temporary file and renames it, so a reader never sees a half-written profile.
    """
    path = Path(path)
    if fmt is None:
        fmt = "json.gz" if path.suffix == ".gz" else "json"
    if fmt not in _SAVE_FORMATS:
        raise InputError(f"cannot save format {fmt!r}; choose one of {', '.join(_SAVE_FORMATS)}")
    data = json.dumps(to_json(snap), separators=(",", ":")).encode()
    if fmt == "json.gz":
        data = gzip.compress(data, mtime=0)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_bytes(data)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def load(path: str | os.PathLike[str]) -> Snapshot:
    """Read a profile written by `save` (JSON, optionally gzip-compressed: detected by content).

    Raises InputError with the reason for a missing, unreadable, empty, truncated or corrupt file.
    """
    try:
        data = Path(path).read_bytes()
    except FileNotFoundError:
        raise InputError(f"{path}: no such file; {_HINT}") from None
    except OSError as e:
        raise InputError(f"{path}: cannot read it ({e.strerror or e}); {_HINT}") from None
    if not data:
        raise InputError(f"{path}: the file is empty; {_HINT}")
    if data[:2] == b"\x1f\x8b":
        try:
            data = gzip.decompress(data)
        except (EOFError, gzip.BadGzipFile, zlib.error) as e:
            raise InputError(f"{path}: truncated or corrupt gzip data ({e}); {_HINT}") from None
    try:
        text = data.decode()
    except UnicodeDecodeError:
        raise InputError(
            f"{path}: binary data, not a stacklens JSON profile (pprof files can be written but "
            f"not read back); {_HINT}"
        ) from None
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise InputError(
            f"{path}: not valid JSON, the file may be truncated ({e.msg} at line {e.lineno} "
            f"column {e.colno}); {_HINT}"
        ) from None
    try:
        return from_json(obj)
    except InputError as e:
        raise InputError(f"{path}: {e}") from None
