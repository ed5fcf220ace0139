"""The committed gRPC modules match daemon/stacklens.proto (regenerate: python -m stacklens.daemon.protogen)."""

from __future__ import annotations

import pathlib

import pytest

from stacklens.daemon import protogen

pytest.importorskip("grpc_tools")


def test_generated_code_is_current(tmp_path: pathlib.Path):
    protogen.generate(tmp_path)
    for name in ("stacklens_pb2.py", "stacklens_pb2_grpc.py"):
        committed = (protogen.HERE / name).read_text()
        assert (tmp_path / name).read_text() == committed, f"{name} is stale: run python -m stacklens.daemon.protogen"
