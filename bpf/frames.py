"""The CCT frame type used by bpf events: `stacklens.cct.Frame` (see CONTRACTS.md).

While `cct/` does not provide it yet, an identical NamedTuple stands in, so events built here
compare equal to frames built by cct once it lands.
"""

from __future__ import annotations

from typing import NamedTuple

try:
    from stacklens.cct import Frame  # type: ignore[attr-defined]
except ImportError:  # cct not written yet

    class Frame(NamedTuple):  # type: ignore[no-redef]
        kind: str
        name: str
        file: str = ""
        line: int = 0

        @classmethod
        def python(cls, file: str, func: str, line: int) -> "Frame":
            return cls("python", func, file, line)

        @classmethod
        def op(cls, name: str) -> "Frame":
            return cls("op", name)

        @classmethod
        def native(cls, lib: str, symbol: str) -> "Frame":
            return cls("native", symbol, lib)

        @classmethod
        def api(cls, name: str) -> "Frame":
            return cls("gpu_api", name)

        @classmethod
        def kernel(cls, name: str) -> "Frame":
            return cls("kernel", name)

        @classmethod
        def other(cls, name: str) -> "Frame":
            return cls("other", name)

        def label(self) -> str:
            if self.kind == "python":
                return f"py:{self.file}:{self.name}:{self.line}"
            if self.kind == "native":
                return f"native:{self.file}:{self.name}"
            prefix = {"op": "op", "gpu_api": "api", "kernel": "kernel", "instruction": "insn"}.get(self.kind)
            return f"{prefix}:{self.name}" if prefix else f"[{self.name.strip('[]')}]"

__all__ = ["Frame"]
