"""The committed gRPC modules match daemon/stacklens.proto as the oldest supported grpcio's
generator writes them (regenerate: python -m stacklens.daemon.protogen)."""

from __future__ import annotations

import pathlib
import re

import pytest

from stacklens.daemon import protogen


@pytest.fixture(scope="module")
def oldest_python():
    try:
        return protogen.oldest_venv()
    except RuntimeError as e:
        pytest.skip(f"cannot build the venv with {protogen.GENERATOR} (package index?): {e}")


def test_generated_code_is_current(tmp_path: pathlib.Path, oldest_python):
    protogen.generate(tmp_path, oldest_python)
    for name in ("stacklens_pb2.py", "stacklens_pb2_grpc.py"):
        committed = (protogen.HERE / name).read_text()
        assert (tmp_path / name).read_text() == committed, f"{name} is stale: run python -m stacklens.daemon.protogen"


def test_generated_code_asks_no_newer_grpcio_or_protobuf_than_pyproject():
    """What broke stacklensd on grpcio 1.84: code from grpcio-tools 1.85.1 refused older grpcio."""
    grpc_mod = (protogen.HERE / "stacklens_pb2_grpc.py").read_text()
    pb_mod = (protogen.HERE / "stacklens_pb2.py").read_text()
    assert "GRPC_GENERATED_VERSION" not in grpc_mod and "_registered_method" not in grpc_mod
    assert "ValidateProtobufRuntimeVersion" not in pb_mod
    pins = dict(p.split("==") for p in protogen.OLDEST)
    deps = (protogen.HERE.parent / "pyproject.toml").read_text()
    for pkg in pins:
        assert re.search(rf'"{pkg}>={re.escape(pins[pkg])}"', deps), f"pyproject must say {pkg}>={pins[pkg]}"
    assert protogen.GENERATOR == f"grpcio-tools=={pins['grpcio']}"
