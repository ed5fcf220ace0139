"""The layout table checked against CPython's own headers: offsetof() compiled for every
interpreter whose (internal) headers are installed here — pyenv's 3.10-3.13 and Debian sid's
3.14 in /var/tmp/chroot-sid (libpython3.14-dev). Skipped per version when absent.

3.10-3.12: every table entry. 3.13+: the field order of `_Py_DebugOffsets` that
parse_debug_offsets() relies on (each field's offset == 24 + 8 * its index).
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from stacklens.introspect import python_layouts as pl
from tests.interpreters import pyenv_prefix

INCLUDES = {
    (3, 10): [str(pyenv_prefix("3.10.13") / "include" / "python3.10")],
    (3, 11): [str(pyenv_prefix("3.11.7") / "include" / "python3.11")],
    (3, 12): [str(pyenv_prefix("3.12.1") / "include" / "python3.12")],
    (3, 13): [str(pyenv_prefix("3.13.0") / "include" / "python3.13")],
    (3, 14): ["/var/tmp/chroot-sid/usr/include/python3.14"],  # + the multiarch pyconfig.h
}

# PyLayout field -> C expression (per version where the C name differs)
TABLE_EXPR = {
    "runtime_interpreters_head": "offsetof(_PyRuntimeState, interpreters.head)",
    "interp_next": "offsetof(PyInterpreterState, next)",
    "interp_threads_head": {(3, 10): "offsetof(PyInterpreterState, tstate_head)",
                            None: "offsetof(PyInterpreterState, threads.head)"},
    "tstate_next": "offsetof(PyThreadState, next)",
    "tstate_interp": "offsetof(PyThreadState, interp)",
    "tstate_thread_id": "offsetof(PyThreadState, thread_id)",
    "tstate_native_thread_id": {(3, 10): "-1", None: "offsetof(PyThreadState, native_thread_id)"},
    "tstate_frame": {(3, 10): "offsetof(PyThreadState, frame)",
                     None: "offsetof(PyThreadState, cframe)"},
    "cframe_current_frame": {(3, 10): "-1", None: "offsetof(_PyCFrame, current_frame)"},
    "frame_previous": {(3, 10): "offsetof(PyFrameObject, f_back)",
                       None: "offsetof(_PyInterpreterFrame, previous)"},
    "frame_code": {(3, 10): "offsetof(PyFrameObject, f_code)",
                   None: "offsetof(_PyInterpreterFrame, f_code)"},
    "frame_instr": {(3, 10): "offsetof(PyFrameObject, f_lasti)",
                    None: "offsetof(_PyInterpreterFrame, prev_instr)"},
    "frame_owner": {(3, 10): "-1", None: "offsetof(_PyInterpreterFrame, owner)"},
    "frame_is_entry": {(3, 11): "offsetof(_PyInterpreterFrame, is_entry)", None: "-1"},
    "owner_shim_min": {(3, 12): "FRAME_OWNED_BY_CSTACK", None: "-1"},
    "code_filename": "offsetof(PyCodeObject, co_filename)",
    "code_name": "offsetof(PyCodeObject, co_name)",
    "code_qualname": {(3, 10): "-1", None: "offsetof(PyCodeObject, co_qualname)"},
    "code_firstlineno": "offsetof(PyCodeObject, co_firstlineno)",
    "code_linetable": "offsetof(PyCodeObject, co_linetable)",
    "code_adaptive": {(3, 10): "-1", None: "offsetof(PyCodeObject, co_code_adaptive)"},
    "ob_type": "offsetof(PyObject, ob_type)",
    "unicode_state": "offsetof(PyASCIIObject, state)",
    "unicode_length": "offsetof(PyASCIIObject, length)",
    "unicode_ascii_size": "sizeof(PyASCIIObject)",
    "unicode_compact_size": "sizeof(PyCompactUnicodeObject)",
    "bytes_size": "offsetof(PyVarObject, ob_size)",
    "bytes_sval": "offsetof(PyBytesObject, ob_sval)",
}

PRELUDE = """#define Py_BUILD_CORE 1
#include <Python.h>
#include <stddef.h>
#include <stdio.h>
#include "internal/pycore_runtime.h"
#include "internal/pycore_interp.h"
#if PY_VERSION_HEX >= 0x030B0000
#include "internal/pycore_frame.h"
#include "internal/pycore_code.h"
#else
#include "frameobject.h"
#endif
"""


def _compile_and_run(tmp_path: Path, version, exprs: list[str]) -> list[int]:
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler")
    incs = INCLUDES[version]
    if not Path(incs[0], "internal").is_dir():
        pytest.skip(f"no CPython {version[0]}.{version[1]} internal headers at {incs[0]}")
    body = "".join(f'  printf("%ld\\n", (long)({e}));\n' for e in exprs)
    src = tmp_path / "offs.c"
    src.write_text(PRELUDE + "int main(void) {\n" + body + "  return 0;\n}\n")
    flags = [f"-I{i}" for i in incs] + [f"-I{incs[0]}/internal"]
    multiarch = Path(incs[0]).parent / "x86_64-linux-gnu" / Path(incs[0]).name
    if multiarch.is_dir():  # Debian: pyconfig.h includes <x86_64-linux-gnu/python3.X/pyconfig.h>
        (tmp_path / "x86_64-linux-gnu").mkdir()
        (tmp_path / "x86_64-linux-gnu" / multiarch.name).symlink_to(multiarch)
        flags.append(f"-I{tmp_path}")
    subprocess.run([cc, "-w", *flags, "-o", str(tmp_path / "offs"), str(src)], check=True)
    out = subprocess.run([str(tmp_path / "offs")], capture_output=True, text=True, check=True)
    return [int(x) for x in out.stdout.split()]


@pytest.mark.parametrize("version", [(3, 10), (3, 11), (3, 12)])
def test_table_matches_headers(tmp_path, version):
    lay = pl.LAYOUTS[version]
    names, exprs = [], []
    for field, expr in TABLE_EXPR.items():
        if isinstance(expr, dict):
            expr = expr.get(version, expr[None])
        names.append(field)
        exprs.append(expr)
    got = dict(zip(names, _compile_and_run(tmp_path, version, exprs)))
    want = {n: getattr(lay, n) for n in names}
    assert got == want


@pytest.mark.parametrize("version", [(3, 13), (3, 14)])
def test_debug_offsets_field_order_matches_headers(tmp_path, version):
    spec = pl.LAYOUTS[version]
    exprs = [f"offsetof(_Py_DebugOffsets, {name})" for name in spec.field_order]
    exprs += ["sizeof(PyCompactUnicodeObject)", "FRAME_OWNED_BY_CSTACK"]
    got = _compile_and_run(tmp_path, version, exprs)
    n = len(spec.field_order)
    assert got[:n] == [24 + 8 * i for i in range(n)]
    assert got[n] == spec.unicode_compact_size
    assert got[n + 1] >= spec.owner_shim_min
