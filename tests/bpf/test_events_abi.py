"""Every C struct in stacklens.h agrees with its ctypes mirror in bpf/events_abi.py (no root)."""

from __future__ import annotations

import ctypes as ct
import shutil
import subprocess

import pytest

from stacklens.bpf.events_abi import ABI_STRUCTS
from stacklens.bpf.program import PROGRAMS


def _fields(cls):
    for name, ctype in cls._fields_:
        yield name, getattr(cls, name).offset, ct.sizeof(ctype)


def test_struct_sizes_and_offsets_match_c(tmp_path):
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler")
    lines = ['#include <stdio.h>', '#include <stddef.h>', '#define SL_ABI_ONLY 1', '#include "stacklens.h"',
             "int main(void) {"]
    for cname, cls in ABI_STRUCTS.items():
        lines.append(f'printf("{cname} %zu 0\\n", sizeof(struct {cname}));')
        for f, _, _ in _fields(cls):
            lines.append(f'printf("{cname}.{f} %zu %zu\\n", offsetof(struct {cname}, {f}), '
                         f'sizeof(((struct {cname} *)0)->{f}));')
    lines += ["return 0;", "}"]
    src = tmp_path / "abi.c"
    src.write_text("\n".join(lines))
    exe = tmp_path / "abi"
    subprocess.run([cc, f"-I{PROGRAMS}", "-o", str(exe), str(src)], check=True)
    out = subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout.split("\n")
    c = {}
    for line in filter(None, out):
        key, *vals = line.split()
        c[key] = tuple(int(v) for v in vals)
    for cname, cls in ABI_STRUCTS.items():
        assert c[cname] == (ct.sizeof(cls), 0), cname
        for f, off, size in _fields(cls):
            assert c[f"{cname}.{f}"] == (off, size), f"{cname}.{f}"
