"""The docs match the repository (issue 19): every file or folder docs/architecture.md names in
backticks exists, the README needs nothing outside the repository, and every relative Markdown
link in README.md and docs/ resolves to a file. Reads files only; no privilege."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).parents[2]
ARCHITECTURE = REPO / "docs" / "architecture.md"
README = REPO / "README.md"
SKIP_DIRS = {".git", ".venv", "__pycache__", "node_modules", ".device"}

CODE_SPAN = re.compile(r"`([^`\n]+)`")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)
FILE_SUFFIXES = (".py", ".toml", ".c", ".h", ".md", ".proto", ".sh", ".tcss", ".service", ".json", ".yml")
LINK = re.compile(r"\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
# Paths of one machine (a checkout, a CI runner, a home), not of the product's install.
MACHINE_PATH = re.compile(r"(?<![\w.~-])/(?:work|check|root|home|Users|mnt|opt|tmp/ci)(?:/|\b)")


def _path_tokens(text: str) -> list[str]:
    """Code spans that look like a repository path: one word with a '/' or a file suffix.
    Absolute paths (the target's or the system's: /proc, /lib/modules/…) and URLs are not ours."""
    out = []
    for tok in CODE_SPAN.findall(text):
        tok = tok.strip()
        if any(c.isspace() for c in tok) or tok.startswith(("/", "$", "~", "-")) or "://" in tok:
            continue
        if any(c in tok for c in "()=<>:,"):
            continue
        if "/" in tok or tok.endswith(FILE_SUFFIXES):
            out.append(tok)
    return out


def _repo_files() -> list[Path]:
    out = []
    stack = [REPO]
    while stack:
        d = stack.pop()
        for p in d.iterdir():
            if p.is_dir():
                if p.name not in SKIP_DIRS:
                    stack.append(p)
                    out.append(p)
            else:
                out.append(p)
    return out


PLACEHOLDER = re.compile(r"(?<![A-Za-z0-9_])[A-Z][A-Z0-9_]+(?![A-Za-z0-9_])")


def _exists(token: str, files: list[Path]) -> bool:
    """A path with a '/' is relative to the repository root, a glob if it has '*' or a
    placeholder in capitals (`inject/gpu/NAME.py`: some vendor's file); a bare file name
    (`tree.py` in the row of `cct/`) exists somewhere in the repository."""
    if "/" in token:
        rel = PLACEHOLDER.sub("*", token.rstrip("/"))
        if "*" in rel:
            return any(True for _ in REPO.glob(rel))
        return (REPO / rel).exists()
    return any(p.name == token for p in files)


def _markdown_files() -> list[Path]:
    return [README] + sorted(p for p in (REPO / "docs").rglob("*.md"))


def test_the_path_finder_sees_paths_and_skips_the_rest():
    text = ("`bpf/session.py`, `introspect/`, `tree.py`, `bpf/programs/*.bpf.c`, `/proc`, "
            "`rule(snapshot, *, config) -> list[Finding]`, `snapshot.unavailable`, `at::_ops::*::call`")
    assert _path_tokens(text) == ["bpf/session.py", "introspect/", "tree.py", "bpf/programs/*.bpf.c"]
    files = _repo_files()
    assert _exists("cct/tree.py", files) and _exists("tree.py", files)
    assert _exists("bpf/programs/*.bpf.c", files)
    assert _exists("analyzer/rules/NAME.py", files) and not _exists("analyzer/rules/NAME.c", files)
    assert not _exists("cct/no_such_file.py", files) and not _exists("no_such_file.py", files)
    assert MACHINE_PATH.search("see /work/main/README.md") and MACHINE_PATH.search("/root/out")
    assert not MACHINE_PATH.search("/lib/modules/$(uname -r)/build, systemd/stacklensd.service")


def test_every_path_the_architecture_page_names_exists():
    tokens = _path_tokens(ARCHITECTURE.read_text())
    assert len(tokens) > 20, "the architecture page names the folders and files of the pipeline"
    files = _repo_files()
    missing = sorted({t for t in tokens if not _exists(t, files)})
    assert not missing, f"docs/architecture.md names paths that do not exist: {missing}"


def test_the_architecture_page_places_every_package():
    """Every package, top-level or nested (`inject/channel/`, `tui/panes/`), is named on the page."""
    text = ARCHITECTURE.read_text()
    packages = sorted(str(p.parent.relative_to(REPO)) for p in REPO.rglob("__init__.py")
                      if p.parent != REPO
                      and not p.parent.relative_to(REPO).parts[0].startswith((".", "tests", "benchmarks")))
    assert {"records", "inject/channel", "cli", "render"} <= set(packages), packages
    missing = [p for p in packages if f"`{p}/" not in text]
    assert not missing, f"docs/architecture.md does not place these packages: {missing}"


def test_the_readme_needs_nothing_outside_the_repository():
    text = README.read_text()
    assert "../" not in text, "README.md points outside the repository"
    found = sorted({m.group(0) for m in MACHINE_PATH.finditer(text)})
    assert not found, f"README.md names paths of one machine: {found}"


def test_the_readmes_two_commands_exist():
    head = README.read_text().split("```", 2)[1]
    assert "bash scripts/setup.sh" in head and "stacklens demo" in head and "bash scripts/test.sh" in head
    assert (REPO / "scripts" / "setup.sh").is_file() and (REPO / "scripts" / "test.sh").is_file()


@pytest.mark.parametrize("doc", _markdown_files(), ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_resolves(doc: Path):
    text = FENCE.sub("", doc.read_text())
    broken = []
    for target in LINK.findall(text):
        if re.match(r"[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue  # a URL, mailto:, or an anchor in the same page
        path = target.split("#", 1)[0]
        if not (doc.parent / path).exists():
            broken.append(target)
    assert not broken, f"{doc.relative_to(REPO)}: links that resolve to nothing: {broken}"


def test_decisions_are_newest_first():
    """docs/decisions.md says "newest first": the dates of its `## YYYY-MM-DD — …` entries never increase."""
    dates = re.findall(r"^## (\d{4}-\d{2}-\d{2}) ", (REPO / "docs" / "decisions.md").read_text(), re.M)
    assert len(dates) > 10, "the decisions page lists its decisions as `## YYYY-MM-DD — title`"
    late = [(a, b) for a, b in zip(dates, dates[1:]) if b > a]
    assert not late, f"docs/decisions.md: entries out of order (newest first), older then newer: {late}"
