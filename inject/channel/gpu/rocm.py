"""Daemon side of the ROCm collector (``inject/agent/gpu/rocm.py``): JSON rows only.

UNTESTED ON AMD HARDWARE (as the collector). Pure: no privilege, nothing read from the target.
RocTracer's records are turned into rows in the target (roctracer's kernel name strings copied
there), so this decoder is the shared row decoder (``rows.py``) over the kinds ROCm sends:
kernel (grid/block 0: roctracer reports none), memcpy (kind "other": no direction), sync, and
api (domain "hip", HIP_API always on, with correlation ids). Hence its one join, declared in
``inject/channel/gpu.VENDORS``: the API-record join; the order join would find no kernel whose zero
grid/block matches a BPF-seen hipLaunchKernel's, and no enable time in the collector's stats.
"""

from __future__ import annotations

from stacklens.inject.channel.gpu.rows import ROW_KINDS, parse_rows

MESSAGES = ROW_KINDS          # the message kinds this vendor's collector sends (records)


def decode(t: str, msg: dict, conn=None) -> list:
    """One message of kind ``t`` (of MESSAGES) -> records; ``ProtocolError`` if malformed. ROCm
    keeps nothing of the connection (``conn``)."""
    return parse_rows(t, msg)
