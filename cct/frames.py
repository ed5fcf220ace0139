"""Frames: one level of a calling context (a Python line, an operator, a native symbol, a kernel).

Pure data, no privilege, no I/O. A `Frame` is a NamedTuple so that hashing and comparing one
(the CCT does both on every insertion) runs in C.

Text labels (used by folded output, the TUI, JSON-free tests and `find`):

    python       py:FILE:FUNC:LINE      parsed from the right: FILE may contain ':'
    op           op:NAME                NAME is everything after 'op:' (aten::addmm)
    native       native:LIB:SYMBOL      LIB ends at the first ':'; SYMBOL may contain '::'
    gpu_api      api:NAME
    kernel       kernel:NAME
    memcpy       memcpy:NAME            a GPU copy (CUPTI): direction and memory kinds, "DtoH (Device -> Pinned)"
    memset       memset:NAME            a GPU memset (CUPTI): the memory kind, "Device"
    instruction  insn:NAME
    backward     backward:NAME          an autograd node the engine ran (AddmmBackward0): below it,
                                        the backward work; above it, the forward context that
                                        created the node
    module       module:CLASS:PATH      a torch.nn.Module instance: its class and attribute path
                                        from the outermost module (`transformer.h.3.attn`; "" for
                                        that module itself or where the path is not known), as
                                        the model view (cct/modelview.py) names module calls
    other        [NAME]

So that every label parses back to its frame, the one field that sits left of a free-form
field and may not contain ':' (FUNC of a python frame, LIB of a native frame, CLASS of a module) is escaped with
'%3A' for ':' and '%25' for '%'; real function, library and class names never need it.
"""

from __future__ import annotations

import re
from typing import NamedTuple

# appended kinds keep their index: the columnar profile stores a frame's kind as its index here
KINDS = ("python", "op", "native", "gpu_api", "kernel", "instruction", "other", "backward", "memcpy", "memset",
         "module")

_PREFIX_OF_KIND = {
    "op": "op:",
    "gpu_api": "api:",
    "kernel": "kernel:",
    "instruction": "insn:",
    "backward": "backward:",
    "memcpy": "memcpy:",
    "memset": "memset:",
}
_KIND_OF_PREFIX = {prefix: kind for kind, prefix in _PREFIX_OF_KIND.items()}
_LINE = re.compile(r"-?[0-9]+")


def _escape(text: str) -> str:
    return text.replace("%", "%25").replace(":", "%3A")


def _unescape(text: str) -> str:
    return text.replace("%3A", ":").replace("%25", "%")


class Frame(NamedTuple):
    """One level of a calling context.

    `file` is the source file of a python frame, the library of a native frame and the class of a
    module frame; `line` is only meaningful for python frames. Other kinds carry just `name`.
    """

    kind: str
    name: str
    file: str = ""
    line: int = 0

    @classmethod
    def python(cls, file: str, func: str, line: int) -> Frame:
        return cls("python", func, file, line)

    @classmethod
    def op(cls, name: str) -> Frame:
        return cls("op", name)

    @classmethod
    def native(cls, lib: str, symbol: str) -> Frame:
        return cls("native", symbol, lib)

    @classmethod
    def api(cls, name: str) -> Frame:
        return cls("gpu_api", name)

    @classmethod
    def kernel(cls, name: str) -> Frame:
        return cls("kernel", name)

    @classmethod
    def memcpy(cls, name: str) -> Frame:
        return cls("memcpy", name)

    @classmethod
    def memset(cls, name: str) -> Frame:
        return cls("memset", name)

    @classmethod
    def instruction(cls, name: str) -> Frame:
        return cls("instruction", name)

    @classmethod
    def backward(cls, name: str) -> Frame:
        return cls("backward", name)

    @classmethod
    def module(cls, path: str, class_name: str) -> Frame:
        return cls("module", path, class_name)

    @classmethod
    def other(cls, name: str) -> Frame:
        """A synthetic frame such as `[truncated]` or `[other]`; surrounding brackets are optional."""
        if len(name) >= 2 and name[0] == "[" and name[-1] == "]":
            name = name[1:-1]
        return cls("other", name)

    def label(self) -> str:
        kind = self.kind
        if kind == "python":
            return f"py:{self.file}:{_escape(self.name)}:{self.line}"
        if kind == "native":
            return f"native:{_escape(self.file)}:{self.name}"
        if kind == "module":
            return f"module:{_escape(self.file)}:{self.name}"
        prefix = _PREFIX_OF_KIND.get(kind)
        if prefix is not None:
            return prefix + self.name
        return f"[{self.name}]"

    @classmethod
    def from_label(cls, label: str) -> Frame:
        """Parse a label written by `label()`; raises ValueError for anything else."""
        if label.startswith("py:"):
            parts = label[3:].rsplit(":", 2)
            if len(parts) != 3 or not _LINE.fullmatch(parts[2]):
                raise ValueError(f"python frame label must be py:FILE:FUNC:LINE, got {label!r}")
            return cls("python", _unescape(parts[1]), parts[0], int(parts[2]))
        if label.startswith("native:"):
            lib, sep, symbol = label[7:].partition(":")
            if not sep:
                raise ValueError(f"native frame label must be native:LIB:SYMBOL, got {label!r}")
            return cls("native", symbol, _unescape(lib))
        if label.startswith("module:"):
            class_name, sep, path = label[7:].partition(":")
            if not sep:
                raise ValueError(f"module frame label must be module:CLASS:PATH, got {label!r}")
            return cls("module", path, _unescape(class_name))
        if len(label) >= 2 and label[0] == "[" and label[-1] == "]":
            return cls("other", label[1:-1])
        prefix, sep, _ = label.partition(":")
        kind = _KIND_OF_PREFIX.get(prefix + sep)
        if kind is None:
            raise ValueError(
                f"unknown frame label {label!r}: expected a py:, op:, native:, module:, api:, "
                "kernel:, insn:, backward:, memcpy: or memset: prefix, or [name]"
            )
        return cls(kind, label[len(prefix) + 1 :])


ROOT = Frame("other", "root")
OTHER = Frame("other", "other")


def python_module_of(file: str) -> str:
    """The dotted module a Python file is (`torch.nn.modules.linear` for a file under
    site-packages, `prep` for a script's /srv/app/prep.py); a pseudo-file (`<string>`) as is."""
    if not file.endswith(".py"):
        return file
    parts = file[:-3].split("/")
    for anchor in ("site-packages", "dist-packages"):
        if anchor in parts:
            parts = parts[len(parts) - parts[::-1].index(anchor):]
            break
    else:
        parts = parts[-1:]
    if len(parts) > 1 and parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(p for p in parts if p)
