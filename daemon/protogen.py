"""Regenerate daemon/stacklens_pb2*.py from daemon/stacklens.proto (needs grpcio-tools).

The generated modules are committed so installs need no compiler; a unit test checks they match.
"""

from __future__ import annotations

import pathlib
import re
import sys
import tempfile

HERE = pathlib.Path(__file__).parent


def generate(out_dir: pathlib.Path) -> None:
    from grpc_tools import protoc

    rc = protoc.main(
        ["protoc", f"-I{HERE}", f"--python_out={out_dir}", f"--grpc_python_out={out_dir}", str(HERE / "stacklens.proto")]
    )
    if rc != 0:
        raise SystemExit(f"protoc failed ({rc})")
    # grpc's generator writes a top-level import; make it package-relative.
    grpc_mod = out_dir / "stacklens_pb2_grpc.py"
    grpc_mod.write_text(re.sub(r"^import stacklens_pb2", "from . import stacklens_pb2", grpc_mod.read_text(), flags=re.M))


def main() -> int:
    with tempfile.TemporaryDirectory() as d:
        generate(pathlib.Path(d))
        for name in ("stacklens_pb2.py", "stacklens_pb2_grpc.py"):
            (HERE / name).write_text((pathlib.Path(d) / name).read_text())
    print("regenerated", HERE / "stacklens_pb2.py")
    return 0


if __name__ == "__main__":
    sys.exit(main())
