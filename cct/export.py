"""The profile's own forms: stacklens JSON (`save` / `load`, docs/profile-format.md) and the
columnar binary form stacklensd sends (`encode_profile` / `decode_profile`); both read back.

Pure functions over a `Snapshot`; only `save` and `load` touch the file system. Metrics listed
in `snapshot.unavailable` were not measured: both forms record them as such, so a reader never
takes them for 0. The formats other tools read (pprof, folded, speedscope) are `stacklens.render`.
"""

from __future__ import annotations

import gzip
import json
import operator
import os
import sys
import zlib
from array import array
from collections import deque
from collections.abc import Iterable, Sequence
from itertools import chain, islice, repeat
from pathlib import Path
from typing import Any

from stacklens.errors import InputError
from stacklens.cct.frames import KINDS, ROOT, Frame
from stacklens.cct.snapshot import Snapshot

JSON_FORMAT = "stacklens.profile"
JSON_VERSION = 1
_HINT = "pass a profile written by stacklens (JSON, .json or .json.gz)"


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
    out = {
        "format": JSON_FORMAT,
        "version": JSON_VERSION,
        "metrics": list(snap.metrics),
        "unavailable": sorted(snap.unavailable),
        "folded_nodes": snap.folded_nodes,
        "meta": snap.meta,
        "frames": frames,
        "nodes": nodes,
    }
    if snap.threaded:
        out["threads"] = _threads_out(snap, range(snap.node_count))
    return out


def _threads_out(snap: Snapshot, new_id: Sequence[int]) -> dict[str, list[list[int]]]:
    """The thread breakdowns as {metric: [[node, tid, count], ...]}, nodes numbered by `new_id`
    (an optional key of both forms: readers that do not know it ignore it)."""
    return {m: [[new_id[n], tid, count] for n, t in sorted(snap._threads[m].items()) for tid, count in t]
            for m in sorted(snap.threaded)}


def _threads_in(raw: Any, n_nodes: int, metrics: list[str]) -> dict[str, dict[int, dict[int, int]]]:
    """Read `_threads_out`'s form back (absent in files from before it: no breakdown)."""
    if raw is None:
        return {}
    what = "\"threads\" must map metrics to lists of [node, tid, count]"
    if not isinstance(raw, dict) or not all(m in metrics and isinstance(v, list) for m, v in raw.items()):
        raise _bad(what)
    out: dict[str, dict[int, dict[int, int]]] = {}
    for m, rows in raw.items():
        by_node = out[m] = {}
        for row in rows:
            if not (isinstance(row, list) and len(row) == 3 and all(map(_is_int, row))
                    and 0 <= row[0] < n_nodes and row[1] > 0):
                raise _bad(f"{what}, each an integer with node < {n_nodes} and tid > 0; got {row!r}")
            by_node.setdefault(row[0], {})[row[1]] = row[2]
    return out


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _bad(what: str) -> InputError:
    return InputError(f"not a valid stacklens profile: {what}; {_HINT}")


def _check_version(obj: dict[str, Any], fmt: str, known: int) -> None:
    version = obj.get("version")
    if version != known:
        if _is_int(version) and version > known:
            raise InputError(
                f"{fmt} format version {version} is newer than this stacklens reads "
                f"({known}); upgrade stacklens"
            )
        raise _bad(f"unsupported version {version!r}")


def _check_header(obj: dict[str, Any]) -> tuple[list[str], list[str], int, dict[str, Any]]:
    """metrics, unavailable, folded_nodes and meta of a JSON or columnar header, checked."""
    metrics = obj.get("metrics")
    if not isinstance(metrics, list) or not metrics or not all(isinstance(m, str) for m in metrics):
        raise _bad("\"metrics\" must be a non-empty list of names")
    if len(set(metrics)) != len(metrics):
        raise _bad("\"metrics\" has duplicates")
    unavailable = obj.get("unavailable", [])
    if not isinstance(unavailable, list) or not all(m in metrics for m in unavailable):
        raise _bad("\"unavailable\" must list some of the metrics")
    folded = obj.get("folded_nodes", 0)
    meta = obj.get("meta", {})
    if not _is_int(folded) or not isinstance(meta, dict):
        raise _bad("\"folded_nodes\" must be an integer and \"meta\" an object")
    return metrics, unavailable, folded, meta


# Readers check whole columns at C speed (set(map(type, ...)), min/max, all(map(...))): a
# Python loop over 100,000 nodes cost ~0.3 s per profile, and `stacklens top` decodes one every
# second. When a bulk check fails, the per-item loops below run to say exactly what is wrong.
_KIND_SET = frozenset(KINDS)
_INT = {int}
_new_frame = tuple.__new__  # Frame is a NamedTuple: tuple.__new__(Frame, (k, n, f, l)) is one


def _frames_slow(raw_frames: list[Any]) -> list[Frame]:
    frames: list[Frame] = []
    for i, raw in enumerate(raw_frames):
        if (
            not isinstance(raw, list)
            or len(raw) != 4
            or raw[0] not in KINDS
            or not all(isinstance(x, str) for x in raw[1:3])
            or not _is_int(raw[3])
        ):
            raise _bad(f"frame {i} must be [kind, name, file, line] with kind one of {', '.join(KINDS)}")
        frames.append(Frame(*raw))
    return frames


def _json_frames(raw_frames: list[Any]) -> list[Frame]:
    if not raw_frames:
        return []
    try:
        ok = (
            set(map(type, raw_frames)) == {list}
            and set(map(len, raw_frames)) == {4}
            and set(map(operator.itemgetter(0), raw_frames)) <= _KIND_SET
            and set(map(type, map(operator.itemgetter(1), raw_frames))) == {str}
            and set(map(type, map(operator.itemgetter(2), raw_frames))) == {str}
            and set(map(type, map(operator.itemgetter(3), raw_frames))) == _INT
        )
    except TypeError:  # an unhashable kind
        ok = False
    if not ok:
        return _frames_slow(raw_frames)
    return list(map(_new_frame, repeat(Frame), raw_frames))


def _nodes_slow(
    raw_nodes: list[Any], frames: list[Frame], metrics: list[str]
) -> tuple[list[Frame], list[int], dict[str, list[int]]]:
    node_frames: list[Frame] = []
    parents: list[int] = []
    columns: dict[str, list[int]] = {m: [0] * len(raw_nodes) for m in metrics}
    seen: set[tuple[int, int]] = set()
    for i, raw in enumerate(raw_nodes):
        if not isinstance(raw, list) or len(raw) != 3 or not isinstance(raw[2], dict):
            raise _bad(f"node {i} must be [parent, frame, {{metric: value}}]")
        parent, frame, values = raw
        if i == 0:
            if parent != -1 or frame != -1:
                raise _bad("node 0 must be the root, [-1, -1, {...}]")
            node_frames.append(ROOT)
        else:
            if not _is_int(parent) or not 0 <= parent < i:
                raise _bad(f"node {i} has parent {parent!r}; parents must come before their children")
            if not _is_int(frame) or not 0 <= frame < len(frames):
                raise _bad(f"node {i} refers to frame {frame!r}, which is not in \"frames\"")
            if (parent, frame) in seen:
                raise _bad(f"node {i} repeats a sibling's frame")
            seen.add((parent, frame))
            node_frames.append(frames[frame])
        parents.append(parent)
        for metric, value in values.items():
            if metric not in columns or not _is_int(value):
                raise _bad(f"node {i} has {metric!r}: {value!r}; values must be integers of listed metrics")
            columns[metric][i] = value
    return node_frames, parents, columns


def _tree_ok(parents: list[int], frame_ids: list[int], n_frames: int) -> bool:
    """Node 0 is the root (-1, -1); every other node has 0 <= parent < itself, a frame id in
    range, and no sibling with the same frame id. Column-wise, in C."""
    n = len(parents)
    if parents[0] != -1 or frame_ids[0] != -1:
        return False
    if n == 1:
        return True
    kids = islice(parents, 1, None)
    fids = frame_ids[1:]
    return (
        min(islice(parents, 1, None)) >= 0
        and all(map(operator.lt, kids, range(1, n)))
        and min(fids) >= 0
        and max(fids) < n_frames
        and len(set(map(operator.add, map(operator.mul, islice(parents, 1, None), repeat(n_frames)), fids))) == n - 1
    )


def _json_nodes(
    raw_nodes: list[Any], frames: list[Frame], metrics: list[str]
) -> tuple[list[Frame], list[int], dict[str, list[int]]]:
    try:
        ok = set(map(type, raw_nodes)) == {list} and set(map(len, raw_nodes)) == {3}
        if ok:
            parents = list(map(operator.itemgetter(0), raw_nodes))
            frame_ids = list(map(operator.itemgetter(1), raw_nodes))
            values = list(map(operator.itemgetter(2), raw_nodes))
            ok = (
                set(map(type, parents)) == _INT
                and set(map(type, frame_ids)) == _INT
                and set(map(type, values)) == {dict}
                and _tree_ok(parents, frame_ids, len(frames))
            )
        if ok:
            present = set(chain.from_iterable(values))
            ok = present <= set(metrics) and set(map(type, chain.from_iterable(map(dict.values, values)))) <= _INT
    except TypeError:
        ok = False
    if not ok:
        return _nodes_slow(raw_nodes, frames, metrics)
    n = len(raw_nodes)
    node_frames = [ROOT]
    node_frames += map(frames.__getitem__, islice(frame_ids, 1, None))
    zeros = [0] * n
    columns = {m: list(map(operator.methodcaller("get", m, 0), values)) if m in present else zeros for m in metrics}
    return node_frames, parents, columns


def from_json(obj: Any) -> Snapshot:
    """Read the JSON form; raises InputError saying what is wrong with anything else."""
    if not isinstance(obj, dict) or obj.get("format") != JSON_FORMAT:
        raise _bad(f"expected a JSON object with \"format\": \"{JSON_FORMAT}\"")
    _check_version(obj, "profile", JSON_VERSION)
    metrics, unavailable, folded, meta = _check_header(obj)

    raw_frames = obj.get("frames", [])
    if not isinstance(raw_frames, list):
        raise _bad("\"frames\" must be a list")
    frames = _json_frames(raw_frames)

    raw_nodes = obj.get("nodes")
    if not isinstance(raw_nodes, list) or not raw_nodes:
        raise _bad("\"nodes\" must be a non-empty list")
    node_frames, parents, columns = _json_nodes(raw_nodes, frames, metrics)
    threads = _threads_in(obj.get("threads"), len(parents), metrics)
    return Snapshot(metrics, node_frames, parents, columns, unavailable=unavailable, folded_nodes=folded,
                    meta=meta, threads=threads)


# -- columnar (binary) form: what stacklensd sends ------------------------------------------
#
# The same content as the JSON form, laid out as little-endian arrays so that a reader builds
# a snapshot with a handful of C-speed calls (array.frombytes, str.split, map) instead of
# parsing and checking 100,000 small JSON lists. Layout: docs/profile-format.md.

COLUMNAR_MAGIC = b"stacklens-columnar\n"
COLUMNAR_FORMAT = "stacklens.columnar"
COLUMNAR_VERSION = 1
_KIND_INDEX = {kind: i for i, kind in enumerate(KINDS)}
_LITTLE = sys.byteorder == "little"


def _le(typecode: str, values: Iterable[int]) -> bytes:
    a = array(typecode, values)
    if not _LITTLE:  # pragma: no cover - no big-endian machine here
        a.byteswap()
    return a.tobytes()


def to_columnar(snap: Snapshot) -> bytes:
    """The columnar binary form (uncompressed). Nodes are written breadth first, so a reader's
    children arrays need no sort. Raises ValueError for what it cannot hold (a value or line
    beyond 64 bits, a NUL in a frame's text, more than 2**31 nodes): `encode_profile` then
    writes JSON instead."""
    n = snap.node_count
    if n >= 2**31:
        raise ValueError("too many nodes for the columnar form")
    kids, start = snap._children, snap._child_start
    order = [0]
    for node in order:  # breadth first: the loop sees what it appends
        order += kids[start[node] : start[node + 1]]
    new_id = [0] * n
    deque(map(new_id.__setitem__, order, range(n)), maxlen=0)
    rest = order[1:]
    parents = [-1]
    parents += map(new_id.__getitem__, map(snap._parents.__getitem__, rest))
    node_frames = list(map(snap._frames.__getitem__, rest))
    distinct = list(dict.fromkeys(node_frames))  # first use order
    frame_id = dict(zip(distinct, range(len(distinct))))
    strings = list(dict.fromkeys(chain(("",), map(operator.itemgetter(1), distinct), map(operator.itemgetter(2), distinct))))
    string_id = dict(zip(strings, range(len(strings))))
    text = "\0".join(strings)
    if text.count("\0") != len(strings) - 1:
        raise ValueError("a frame's name or file contains a NUL character")
    blob = text.encode("utf-8", "surrogatepass")
    columns = [m for m in snap.metrics if any(snap._excl[m])]
    try:
        sections = [
            _le("i", parents),
            _le("i", chain((-1,), map(frame_id.__getitem__, node_frames))),
            *(_le("q", map(snap._excl[m].__getitem__, order)) for m in columns),
            bytes(map(_KIND_INDEX.__getitem__, map(operator.itemgetter(0), distinct))),
            _le("i", map(string_id.__getitem__, map(operator.itemgetter(1), distinct))),
            _le("i", map(string_id.__getitem__, map(operator.itemgetter(2), distinct))),
            _le("q", map(operator.itemgetter(3), distinct)),
            blob,
        ]
    except OverflowError as e:
        raise ValueError(f"a value does not fit the columnar form's 64-bit integers ({e})") from None
    head = {
        "format": COLUMNAR_FORMAT,
        "version": COLUMNAR_VERSION,
        "metrics": list(snap.metrics),
        "unavailable": sorted(snap.unavailable),
        "folded_nodes": snap.folded_nodes,
        "meta": snap.meta,
        "nodes": n,
        "frames": len(distinct),
        "strings": len(strings),
        "string_bytes": len(blob),
        "columns": columns,
    }
    if snap.threaded:   # at most MAX_THREADS rows per node and metric (cct/threads.py): in the header
        head["threads"] = _threads_out(snap, new_id)
    header = json.dumps(head, separators=(",", ":")).encode()
    return b"".join([COLUMNAR_MAGIC, len(header).to_bytes(4, "little"), header, *sections])


def _count(header: dict[str, Any], key: str, least: int) -> int:
    value = header.get(key)
    if not _is_int(value) or value < least:
        raise _bad(f"header \"{key}\" must be an integer >= {least}")
    return value


def _columnar_header(view: memoryview) -> tuple[dict[str, Any], int]:
    """The header of a columnar profile (its format and version checked), and where the
    sections after it start."""
    m = len(COLUMNAR_MAGIC)
    if bytes(view[:m]) != COLUMNAR_MAGIC:
        raise _bad("no columnar profile header")
    if len(view) < m + 4:
        raise _bad("the columnar profile is truncated in its header")
    hlen = int.from_bytes(view[m : m + 4], "little")
    try:
        header = json.loads(bytes(view[m + 4 : m + 4 + hlen]))
    except (ValueError, UnicodeDecodeError) as e:
        raise _bad(f"the columnar header is not valid JSON ({e})") from None
    if not isinstance(header, dict) or header.get("format") != COLUMNAR_FORMAT:
        raise _bad(f"the columnar header must be a JSON object with \"format\": \"{COLUMNAR_FORMAT}\"")
    _check_version(header, "columnar profile", COLUMNAR_VERSION)
    return header, m + 4 + hlen


def from_columnar(data: bytes | bytearray | memoryview) -> Snapshot:
    """Read the columnar form (uncompressed); InputError saying what is wrong with anything else."""
    view = memoryview(data).cast("B")
    header, pos = _columnar_header(view)
    metrics, unavailable, folded, meta = _check_header(header)
    n = _count(header, "nodes", 1)
    n_frames = _count(header, "frames", 0)
    n_strings = _count(header, "strings", 1)
    n_bytes = _count(header, "string_bytes", 0)
    columns = header.get("columns")
    if not isinstance(columns, list) or not all(c in metrics for c in columns) or len(set(columns)) != len(columns):
        raise _bad("header \"columns\" must list distinct metrics")
    expected = pos + n * (8 + 8 * len(columns)) + n_frames * 17 + n_bytes
    if len(view) != expected:
        what = "truncated" if len(view) < expected else "followed by extra bytes"
        raise _bad(f"the columnar profile has {len(view)} bytes where its header promises {expected} ({what})")

    def take(typecode: str, count: int) -> list[int]:
        nonlocal pos
        a = array(typecode)
        end = pos + a.itemsize * count
        a.frombytes(view[pos:end])
        pos = end
        if not _LITTLE:  # pragma: no cover
            a.byteswap()
        return a.tolist()

    parents = take("i", n)
    frame_ids = take("i", n)
    values = {c: take("q", n) for c in columns}
    kinds = bytes(view[pos : pos + n_frames])
    pos += n_frames
    name_ids = take("i", n_frames)
    file_ids = take("i", n_frames)
    lines = take("q", n_frames)
    try:
        strings = str(view[pos:], "utf-8", "surrogatepass").split("\0")
    except UnicodeDecodeError as e:
        raise _bad(f"the string table is not UTF-8 ({e})") from None
    if len(strings) != n_strings:
        raise _bad(f"the string table holds {len(strings)} strings, not {n_strings}")
    if n_frames and (
        max(kinds) >= len(KINDS)
        or min(name_ids) < 0
        or min(file_ids) < 0
        or max(name_ids) >= n_strings
        or max(file_ids) >= n_strings
    ):
        raise _bad(f"a frame has a kind outside 0..{len(KINDS) - 1} or a string index outside the table")
    if not _tree_ok(parents, frame_ids, n_frames):
        if parents[0] != -1 or frame_ids[0] != -1:
            raise _bad("node 0 must be the root, with parent -1 and frame -1")
        for i in range(1, n):
            if not 0 <= parents[i] < i:
                raise _bad(f"node {i} has parent {parents[i]}; parents must come before their children")
            if not 0 <= frame_ids[i] < n_frames:
                raise _bad(f"node {i} refers to frame {frame_ids[i]}, which is not in the frame table")
        raise _bad("a node repeats a sibling's frame")

    frames = list(
        map(
            _new_frame,
            repeat(Frame),
            zip(
                map(KINDS.__getitem__, kinds),
                map(strings.__getitem__, name_ids),
                map(strings.__getitem__, file_ids),
                lines,
            ),
        )
    )
    node_frames = [ROOT]
    node_frames += map(frames.__getitem__, islice(frame_ids, 1, None))
    zeros = (0,) * n  # one shared column for every metric with no data
    excl = {m: values.get(m, zeros) for m in metrics}
    threads = _threads_in(header.get("threads"), n, metrics)
    return Snapshot(metrics, node_frames, parents, excl, unavailable=unavailable, folded_nodes=folded, meta=meta,
                    threads=threads)


def encode_profile(snap: Snapshot) -> bytes:
    """A snapshot as stacklensd sends it (`SnapshotResponse.profile`): the gzip-compressed
    columnar form, or gzip JSON when the columnar form cannot hold it. `decode_profile` reads
    both."""
    try:
        data = to_columnar(snap)
    except ValueError:
        data = json.dumps(to_json(snap), separators=(",", ":")).encode()
    return gzip.compress(data, compresslevel=1, mtime=0)


def _decode_bytes(data: bytes) -> Snapshot:
    """An uncompressed profile: columnar (by its magic) or JSON."""
    if data[: len(COLUMNAR_MAGIC)] == COLUMNAR_MAGIC:
        return from_columnar(data)
    try:
        text = data.decode()
    except UnicodeDecodeError:
        raise InputError(
            "binary data, not a stacklens profile (pprof files can be written but not read back); " + _HINT
        ) from None
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise InputError(
            f"not valid JSON, the data may be truncated ({e.msg} at line {e.lineno} column {e.colno}); {_HINT}"
        ) from None
    return from_json(obj)


def _gunzip(data: bytes) -> bytes:
    try:
        return gzip.decompress(data)
    except (EOFError, gzip.BadGzipFile, zlib.error) as e:
        raise InputError(f"truncated or corrupt gzip data ({e}); {_HINT}") from None


def decode_profile(data: bytes) -> Snapshot:
    """Read `SnapshotResponse.profile`: gzip of the columnar form or of JSON (older daemons).

    Raises InputError saying what is wrong with anything else."""
    if data[:2] != b"\x1f\x8b":
        raise InputError(f"a profile from stacklensd must be gzip-compressed; {_HINT}")
    return _decode_bytes(_gunzip(data))


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
    """Read a profile written by `save` (JSON, optionally gzip-compressed: detected by content),
    or the columnar form (`to_columnar`, `encode_profile`).

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
    try:
        if data[:2] == b"\x1f\x8b":
            data = _gunzip(data)
        return _decode_bytes(data)
    except InputError as e:
        raise InputError(f"{path}: {e}") from None
