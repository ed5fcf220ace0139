"""Shared fixtures: tier markers by folder, and capability probes for root-only tiers."""

from __future__ import annotations

import pathlib

import pytest

TESTS = pathlib.Path(__file__).parent


def pytest_collection_modifyitems(config, items):
    for item in items:
        parts = pathlib.Path(str(item.fspath)).relative_to(TESTS).parts
        tier = parts[0] if len(parts) > 1 else "unit"
        if tier in ("integration", "bpf", "gpu"):
            item.add_marker(getattr(pytest.mark, tier))
