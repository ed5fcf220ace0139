"""One uprobe_multi BPF link for many offsets of one file (kernel >= 6.6), via raw bpf().

`bpf_syscall` is the one raw bpf() call of the package (bpf/costs.py loads and turns on
statistics through it); `uprobe_multi_supported` says whether this kernel has uprobe_multi.
Requires CAP_BPF + CAP_PERFMON (root). Attaching ~3,100 offsets is one syscall (~0.01-0.2 s);
closing the link fd detaches all of them at once (~0.05 s), where per-probe perf-event uprobes
each cost a kernel synchronization (~107 ms measured) to remove.
"""

from __future__ import annotations

import ctypes as ct
import os
import re

SYS_bpf = 321  # x86-64
BPF_LINK_CREATE = 28
BPF_TRACE_UPROBE_MULTI = 48
BPF_F_UPROBE_MULTI_RETURN = 1

_libc = ct.CDLL(None, use_errno=True)
_libc.syscall.restype = ct.c_long
_UPROBE_MULTI: bool | None = None


def bpf_syscall(cmd: int, attr: ct.Structure | ct.Array, what: str = "bpf()",
                error: type[OSError] = OSError) -> int:
    """bpf(cmd, &attr, sizeof(attr)): its result (an fd for the commands used here). Raises
    `error`(errno, "WHAT: strerror") when it fails."""
    fd = _libc.syscall(SYS_bpf, cmd, ct.byref(attr), ct.sizeof(attr))
    if fd < 0:
        err = ct.get_errno()
        raise error(err, f"{what}: {os.strerror(err)}")
    return fd


def uprobe_multi_supported() -> bool:
    """Kernel >= 6.6 with CONFIG_UPROBES: checked once via the kernel version."""
    global _UPROBE_MULTI
    if _UPROBE_MULTI is None:
        m = re.match(r"(\d+)\.(\d+)", os.uname().release)
        _UPROBE_MULTI = bool(m) and (int(m.group(1)), int(m.group(2))) >= (6, 6)
    return _UPROBE_MULTI


class _UprobeMultiAttr(ct.Structure):
    _fields_ = [
        ("prog_fd", ct.c_uint32),
        ("target_fd", ct.c_uint32),
        ("attach_type", ct.c_uint32),
        ("flags", ct.c_uint32),
        ("path", ct.c_uint64),
        ("offsets", ct.c_uint64),
        ("ref_ctr_offsets", ct.c_uint64),
        ("cookies", ct.c_uint64),
        ("cnt", ct.c_uint32),
        ("um_flags", ct.c_uint32),
        ("pid", ct.c_uint32),
        ("_pad", ct.c_uint8 * 84),  # the rest of union bpf_attr, zeroed
    ]


class UprobeMultiError(OSError):
    pass


def attach_uprobe_multi(prog_fd: int, path: str, offsets: list[int], cookies: list[int],
                        pid: int = 0, retprobe: bool = False) -> int:
    """Create the link; return its fd (close it to detach). Raises UprobeMultiError(errno)."""
    if not offsets:
        raise ValueError("no offsets to attach")
    n = len(offsets)
    offs = (ct.c_uint64 * n)(*offsets)
    cks = (ct.c_uint64 * n)(*cookies)
    cpath = ct.create_string_buffer(os.fsencode(path))
    attr = _UprobeMultiAttr()
    attr.prog_fd = prog_fd
    attr.attach_type = BPF_TRACE_UPROBE_MULTI
    attr.path = ct.addressof(cpath)
    attr.offsets = ct.addressof(offs)
    attr.cookies = ct.addressof(cks)
    attr.cnt = n
    attr.um_flags = BPF_F_UPROBE_MULTI_RETURN if retprobe else 0
    attr.pid = pid
    return bpf_syscall(BPF_LINK_CREATE, attr, f"uprobe_multi link on {path} ({n} offsets)", UprobeMultiError)
