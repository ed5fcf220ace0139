"""The columnar wire form (`to_columnar` / `from_columnar`, `encode_profile` / `decode_profile`),
and the bulk-checked `from_json`: round trips, the JSON form still read, malformed input."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stacklens.cct import CCT, Frame, Snapshot
from stacklens.cct.export import (
    COLUMNAR_MAGIC,
    decode_profile,
    encode_profile,
    from_columnar,
    from_json,
    load,
    to_columnar,
    to_json,
)
from stacklens.daemon import client
from stacklens.errors import InputError
from stacklens.tui.testing import synthetic_snapshot

from tests.unit.test_export import FRAMES, events, sample


def structure(snap: Snapshot) -> dict[tuple[Frame, ...], tuple[tuple[int, ...], tuple[int, ...]]]:
    """Every node (zero-valued ones too) by path: exclusive and inclusive values."""
    return {
        snap.path(n): (
            tuple(snap.exclusive(n, m) for m in snap.metrics),
            tuple(snap.inclusive(n, m) for m in snap.metrics),
        )
        for n in range(snap.node_count)
    }


def same(a: Snapshot, b: Snapshot) -> None:
    assert b == a
    assert b.node_count == a.node_count
    assert b.metrics == a.metrics and b.unavailable == a.unavailable
    assert b.folded_nodes == a.folded_nodes and b.meta == a.meta
    assert structure(b) == structure(a)
    for n in range(b.node_count):  # children() agrees with parent() after the breadth-first renumbering
        assert all(b.parent(c) == n for c in b.children(n))
    assert sum(len(b.children(n)) for n in range(b.node_count)) == b.node_count - 1


def columnar_header(data: bytes) -> tuple[dict, int]:
    m = len(COLUMNAR_MAGIC)
    hlen = int.from_bytes(data[m : m + 4], "little")
    return json.loads(data[m + 4 : m + 4 + hlen]), m + 4 + hlen


def with_header(data: bytes, **changes) -> bytes:
    header, body = columnar_header(data)
    header.update(changes)
    raw = json.dumps(header).encode()
    return COLUMNAR_MAGIC + len(raw).to_bytes(4, "little") + raw + data[body:]


# ---- round trips -------------------------------------------------------------------------


def test_round_trip_sample() -> None:
    snap = sample()
    data = to_columnar(snap)
    assert data.startswith(COLUMNAR_MAGIC)
    same(snap, from_columnar(data))
    same(snap, decode_profile(encode_profile(snap)))
    same(snap, client.decode_profile(encode_profile(snap)))


@given(events, st.integers(-5, 50), st.booleans())
def test_round_trip_property(evs, folded, with_meta) -> None:
    tree = CCT(max_nodes=None)
    for path, metric, value in evs:
        tree.add(path, metric, value)
    tree._folded = folded
    snap = tree.snapshot(meta={"pid": 1, "argv": ["a", "b"]} if with_meta else None, unavailable={"sync_wait_ns"})
    try:
        data = to_columnar(snap)
    except ValueError as e:  # sums past 64 bits (values up to 2**62): refused, and the JSON form holds them
        assert "64-bit" in str(e)
        same(snap, decode_profile(encode_profile(snap)))
        return
    back = from_columnar(data)
    same(snap, back)
    assert to_columnar(back) == to_columnar(snap)  # already breadth first: a fixed point


def test_round_trip_large_breadth_first_and_root_values() -> None:
    snap = synthetic_snapshot(5_000, seed=3)
    back = decode_profile(encode_profile(snap))
    same(snap, back)
    parents = [back.parent(n) for n in range(back.node_count)]
    assert parents == sorted(parents)  # written breadth first
    root_only = CCT()
    root_only.add((), "cpu_samples", 7)
    same(root_only.snapshot(), from_columnar(to_columnar(root_only.snapshot())))
    same(CCT().snapshot(), from_columnar(to_columnar(CCT().snapshot())))


def test_text_edge_cases_and_int64_limits() -> None:
    tree = CCT(max_nodes=None)
    odd = (
        Frame.python("/srv/ünïcode ✓.py", "fn:with:colons", 2**40),
        Frame.native("/lib/\udcffbad-utf8.so", "sym;semi\nline"),  # a surrogate-escaped file name
        Frame.kernel(""),
    )
    tree.add(odd, "gpu_time_ns", 2**63 - 1)
    tree.add(odd[:1], "gpu_time_ns", -(2**63))
    snap = tree.snapshot(meta={"note": "ü"})
    same(snap, from_columnar(to_columnar(snap)))


def test_encode_falls_back_to_json_for_what_columns_cannot_hold() -> None:
    for tree_frames, value in (((Frame.op("a\0b"),), 1), ((Frame.op("big"),), 2**64)):
        tree = CCT()
        tree.add(tree_frames, "cpu_samples", value)
        snap = tree.snapshot()
        with pytest.raises(ValueError):
            to_columnar(snap)
        data = gzip.decompress(encode_profile(snap))
        assert json.loads(data)["format"] == "stacklens.profile"
        same(snap, decode_profile(encode_profile(snap)))


def test_old_wire_format_still_read() -> None:
    """Daemons before the columnar form sent gzip stacklens JSON."""
    snap = synthetic_snapshot(2_000, seed=1)
    old = gzip.compress(json.dumps(to_json(snap), separators=(",", ":")).encode(), compresslevel=1)
    same(snap, decode_profile(old))
    same(snap, client.decode_profile(old))


def test_load_reads_the_columnar_form(tmp_path: Path) -> None:
    snap = sample()
    (tmp_path / "p.slc").write_bytes(to_columnar(snap))
    (tmp_path / "p.slc.gz").write_bytes(encode_profile(snap))
    same(snap, load(tmp_path / "p.slc"))
    same(snap, load(tmp_path / "p.slc.gz"))
    (tmp_path / "cut.slc").write_bytes(to_columnar(snap)[:-3])
    with pytest.raises(InputError, match="cut.slc.*truncated"):
        load(tmp_path / "cut.slc")


def test_from_json_bulk_path_matches_per_node_checks() -> None:
    snap = synthetic_snapshot(3_000, seed=2)
    obj = json.loads(json.dumps(to_json(snap)))
    same(snap, from_json(obj))
    # bools are not integers, wherever they are
    for mutate in (
        lambda o: o["nodes"][5].__setitem__(0, True),
        lambda o: o["nodes"][5][2].update(cpu_samples=True),
        lambda o: o["frames"][3].__setitem__(3, False),
    ):
        bad = json.loads(json.dumps(obj))
        mutate(bad)
        with pytest.raises(InputError):
            from_json(bad)
    unhashable = json.loads(json.dumps(obj))
    unhashable["frames"][0][0] = ["python"]
    with pytest.raises(InputError, match="frame 0 must be"):
        from_json(unhashable)


# ---- malformed input ---------------------------------------------------------------------


def good() -> bytes:
    return to_columnar(sample())


def patch_section(data: bytes, offset: int, value: int, size: int = 4) -> bytes:
    _, body = columnar_header(data)
    out = bytearray(data)
    out[body + offset : body + offset + size] = value.to_bytes(size, "little", signed=True)
    return bytes(out)


def test_columnar_rejects_with_a_reason() -> None:
    data = good()
    header, body = columnar_header(data)
    n, n_frames = header["nodes"], header["frames"]
    frames_at = 8 * n + 8 * n * len(header["columns"])  # kinds, then names, files, lines
    strings_at = frames_at + 17 * n_frames
    cases = [
        (b"stacklens-columnaX\n" + data[len(COLUMNAR_MAGIC) :], "no columnar profile header"),
        (data[: len(COLUMNAR_MAGIC) + 2], "truncated in its header"),
        (data[:-1], "truncated"),
        (data + b"\0", "extra bytes"),
        (COLUMNAR_MAGIC + (5).to_bytes(4, "little") + b"{nope" + data[body:], "header is not valid JSON"),
        (with_header(data, format="other"), "format"),
        (with_header(data, version=99), "newer than this stacklens.*upgrade"),
        (with_header(data, version="1"), "unsupported version"),
        (with_header(data, metrics=[]), "metrics"),
        (with_header(data, unavailable=["nope"]), "unavailable"),
        (with_header(data, nodes=0), "\"nodes\" must be an integer >= 1"),
        (with_header(data, nodes=n + 1), "promises"),
        (with_header(data, columns=["nope"]), "columns"),
        (with_header(data, strings=header["strings"] + 1), "string table holds"),
        (patch_section(data, 0, 0), "node 0 must be the root"),
        (patch_section(data, 4 * 3, 3), "node 3 has parent 3"),
        (patch_section(data, 4 * n + 4 * 2, n_frames), "node 2 refers to frame"),
        (patch_section(data, frames_at, 100, size=1), "kind outside"),
        (patch_section(data, frames_at + n_frames, header["strings"]), "string index outside"),
        (patch_section(data, strings_at, -1, size=1), "not UTF-8"),
    ]
    for bad, message in cases:
        with pytest.raises(InputError, match=message):
            from_columnar(bad)


def test_columnar_rejects_repeated_sibling_frames() -> None:
    tree = CCT()
    tree.add((Frame.op("a"),), "cpu_samples", 1)
    tree.add((Frame.op("b"),), "cpu_samples", 1)
    data = to_columnar(tree.snapshot())
    header, _ = columnar_header(data)
    # node 2's frame id (1) becomes node 1's (0): two children of the root with one frame
    with pytest.raises(InputError, match="repeats a sibling's frame"):
        from_columnar(patch_section(data, 4 * header["nodes"] + 4 * 2, 0))


def test_decode_profile_errors() -> None:
    with pytest.raises(InputError, match="gzip-compressed"):
        decode_profile(good())
    with pytest.raises(InputError, match="truncated or corrupt gzip"):
        decode_profile(encode_profile(sample())[:20])
    with pytest.raises(InputError, match="binary data"):
        decode_profile(gzip.compress(bytes(range(256))))
    with pytest.raises(InputError, match="not valid JSON"):
        decode_profile(gzip.compress(b'{"format": '))
    with pytest.raises(InputError, match="not a valid stacklens profile"):
        decode_profile(gzip.compress(b"[1, 2]"))


@settings(max_examples=300)
@given(st.data())
def test_corrupt_columnar_fails_only_with_input_error(data) -> None:
    blob = bytearray(good())
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, len(blob) - 1))
        blob[i] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(0, len(blob)))
    try:
        snap = from_columnar(bytes(blob[:cut] if data.draw(st.booleans()) else blob))
    except InputError:
        return
    assert isinstance(snap, Snapshot)
    structure(snap)  # a snapshot that came back is walkable


def test_snapshot_children_without_sort_for_breadth_first_parents() -> None:
    frames = [Frame.other("root")] + [Frame.op(f"f{i}") for i in range(6)]
    parents = [-1, 0, 0, 1, 1, 2, 2]
    snap = Snapshot(["x"], frames, parents, {"x": [0, 1, 2, 3, 4, 5, 6]})
    assert [snap.children(n) for n in range(7)] == [(1, 2), (3, 4), (5, 6), (), (), (), ()]
    assert snap.inclusive(1, "x") == 8 and snap.total("x") == 21
    shuffled = Snapshot(["x"], frames, [-1, 0, 0, 2, 1, 1, 0], {"x": [0] * 7})
    assert [shuffled.children(n) for n in range(3)] == [(1, 2, 6), (4, 5), (3,)]


def test_frames_used_by_the_property_tests_cover_every_kind_but_gpu_api() -> None:
    assert {f.kind for f in FRAMES} >= {"python", "op", "native", "kernel", "other", "instruction"}
