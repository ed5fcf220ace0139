"""Where the test machine keeps its extra CPython builds: pyenv's, under PYENV_ROOT (else
~/.pyenv), as `pyenv install` puts them. Tests that need one skip when it is not there."""

from __future__ import annotations

import os
from pathlib import Path

PYENV_ROOT = Path(os.environ.get("PYENV_ROOT") or Path.home() / ".pyenv")


def pyenv_prefix(full: str) -> Path:
    """The install prefix of pyenv's CPython `full` ("3.11.7")."""
    return PYENV_ROOT / "versions" / full


def pyenv_python(full: str) -> str:
    """pyenv's CPython `full` ("3.11.7"): its bin/python3."""
    return str(pyenv_prefix(full) / "bin" / "python3")
