"""Take the recording machine's paths out of recorded profiles (tests/data/README.md).

A recording names files as the recording machine saw them: the checkout (`CHECKOUT/tests/...`),
the venv's site-packages, pyenv's standard library, a home directory. This rewrites them in
place, in JSON and gzip'd JSON files, and touches nothing else (the text is edited where the
paths are, so the layout of the file stays as it was):

- a file under site-packages: `site-packages/torch/nn/modules/linear.py`;
- the standard library of a pyenv or venv interpreter: `/usr/lib/python3.11/typing.py`, where
  Debian keeps it (rules that tell library from user code look for `/lib/python3`);
- a file of the checkout: repository-relative, `tests/targets/scenario_layout.py`;
- anything else in a home directory: `~/out/run`.

    python tests/data/relativize.py                    # every profile under tests/data/
    python tests/data/relativize.py NEW.json [...]     # the files named

Prints each file it changed. Stdlib only; tests/unit/test_no_machine_paths.py reports what is left.
"""

from __future__ import annotations

import gzip
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# A path of one machine, up to what ends it in a profile: a quote, whitespace, or the `:` / `;`
# of a frame label or a path of them (`py:CHECKOUT/x.py:main:12;op:...`).
MACHINE_PATH = re.compile(r"(?<![\w.~}\])-])/(?:work|check|root|home|tmp/pytest-of-[^/\"\s]*|tmp/fresh[^/\"\s]*)"
                          r"/[^\"\s:;,\\)\]']*")
LIBRARY = re.compile(r"/(?:site|dist)-packages/(.*)")
STDLIB = re.compile(r"/lib/(python3\.\d+)/(.*)")
CHECKOUT = re.compile(r"/(?:work|check)/[^/]+/(.*)")
HOME = re.compile(r"/(?:root|home/[^/]+)/(.*)")


def _top_level() -> set[str]:
    """The repository's top-level entries, by which a checkout's path is recognised."""
    out = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    return {line.split("/", 1)[0] for line in out.splitlines() if line}


def neutral(path: str, top: set[str]) -> str:
    """The form of `path` that names no machine (see the module docstring); `path` if none fits."""
    if m := LIBRARY.search(path):
        return f"site-packages/{m[1]}"
    if m := STDLIB.search(path):
        return f"/usr/lib/{m[1]}/{m[2]}"
    parts = path.split("/")
    for i in range(2, len(parts)):
        if parts[i] in top:
            return "/".join(parts[i:])
    if m := CHECKOUT.fullmatch(path):
        return m[1]
    if m := HOME.fullmatch(path):
        return f"~/{m[1]}"
    return path


def relativize_text(text: str, top: set[str]) -> str:
    return MACHINE_PATH.sub(lambda m: neutral(m[0], top), text)


def relativize_file(path: Path, top: set[str]) -> bool:
    """Rewrite one JSON or .gz file in place; whether it changed."""
    raw = path.read_bytes()
    zipped = path.suffix == ".gz"
    text = (gzip.decompress(raw) if zipped else raw).decode("utf-8")
    new = relativize_text(text, top)
    if new == text:
        return False
    data = new.encode("utf-8")
    path.write_bytes(gzip.compress(data, mtime=0) if zipped else data)
    return True


def main(argv: list[str]) -> int:
    here = Path(__file__).parent
    files = [Path(a) for a in argv] or sorted(p for p in here.rglob("*") if p.name.endswith((".json", ".json.gz")))
    top = _top_level()
    for f in files:
        if relativize_file(f, top):
            print(f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
