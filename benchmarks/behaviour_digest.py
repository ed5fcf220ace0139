"""Digest of what the recorded profiles turn into: a refactoring must leave it unchanged.

Loads every profile under tests/data (JSON, gzip'd JSON), and for each one hashes `analyze()`'s
findings, every output format of every metric (render/formats.py), the columnar round trip and a
CCT rebuilt from the snapshot's stacks. One line a profile, then the digest of them all.

    .venv/bin/python benchmarks/behaviour_digest.py            # digest lines
    .venv/bin/python benchmarks/behaviour_digest.py --quiet    # the total only

Run it before and after a move (issue 45, acceptance 4): the same total means the same output.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

from stacklens.analyzer import analyze  # noqa: E402
from stacklens.cct import CCT, export  # noqa: E402
from stacklens.errors import InputError  # noqa: E402
from stacklens.render.formats import FORMATS  # noqa: E402


def _finding_text(finding) -> str:
    raw = dataclasses.asdict(finding) if dataclasses.is_dataclass(finding) else vars(finding)
    return json.dumps(raw, sort_keys=True, default=repr)


def profile_digest(path: Path) -> str:
    """The hash of everything one recorded profile renders to."""
    snap = export.load(path)        # InputError: not a profile
    h = hashlib.sha256()
    for finding in analyze(snap):
        h.update(_finding_text(finding).encode())
    for fmt in FORMATS.values():
        for metric in (snap.metrics if fmt.per_metric else snap.metrics[:1]):
            try:
                out = fmt.render(snap, metric)
            except InputError as e:     # a metric not measured: its message is output too
                out = str(e)
            h.update(out if isinstance(out, bytes) else out.encode())
    again = export.from_columnar(export.to_columnar(snap))
    h.update(json.dumps(export.to_json(again), sort_keys=True).encode())
    for tree in rebuilt(snap):
        h.update(json.dumps(export.to_json(tree.snapshot()), sort_keys=True).encode())
    return h.hexdigest()[:16]


def rebuilt(snap) -> list[CCT]:
    """The profile's contexts added again to trees: uncapped, under a node cap that folds, under
    a byte cap that folds, and one sample per thread count (`add_sample`)."""
    measured = [m for m in snap.metrics if m not in snap.unavailable]
    paths = list(snap.iter_paths())
    trees = [CCT(measured, max_nodes=None), CCT(measured, max_nodes=max(2, len(paths) // 3)),
             CCT(measured, max_nodes=None, max_bytes=max(1, 40 * len(paths)))]
    for tree in trees:
        for path, deltas in paths:
            tree.add_many(path, {m: v for m, v in deltas.items() if m in measured})
    by_thread = CCT(measured, max_nodes=max(2, len(paths) // 2))
    for node in range(1, snap.node_count):
        for metric in snap.threaded:
            for tid, count in snap.threads(node, metric):
                by_thread.add_sample(snap.path(node), metric, tid, count)
    return trees + [by_thread, trees[0].copy()]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quiet", action="store_true", help="print the total digest only")
    args = ap.parse_args(argv)
    total = hashlib.sha256()
    paths = sorted(p for p in (REPO / "tests" / "data").rglob("*")
                   if p.name.endswith((".json", ".json.gz")) and p.is_file())
    for path in paths:
        try:
            export.load(path)
        except InputError:
            continue            # not a profile (a table, a recorded buffer)
        digest = profile_digest(path)
        total.update(f"{path.relative_to(REPO)} {digest}\n".encode())
        if not args.quiet:
            print(digest, path.relative_to(REPO))
    print("total", total.hexdigest()[:16])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
