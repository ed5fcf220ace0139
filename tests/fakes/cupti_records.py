"""CUPTI copy and memset activity records as ctypes mirrors of cupti_activity.h (CUDA 12.8-13.x,
CUPTI_API_VERSION 130001 checked: tests/unit/test_cupti_copy_layouts.py compiles the header when
it is installed and compares sizes and offsets).

For tests only: the agent takes its layouts at run time from cupti-python's record dtypes
(inject/agent/gpu/cupti.py `_layout`); these mirrors build the same dtypes (numpy reads a ctypes
Structure) and pack synthetic records byte for byte as CUPTI lays them out. PACKED_ALIGNMENT on
GCC is packed + aligned(8): `_pack_ = 1` with the header's own padding fields, size rounded to 8.
"""

from __future__ import annotations

import ctypes as ct
import enum

u8, u16, u32, u64 = ct.c_uint8, ct.c_uint16, ct.c_uint32, ct.c_uint64

KIND_MEMCPY, KIND_MEMSET = 1, 2   # CUpti_ActivityKind


class ActivityMemcpy6(ct.Structure):
    _pack_ = 1
    _fields_ = [("kind", u32), ("copyKind", u8), ("srcKind", u8), ("dstKind", u8), ("flags", u8),
                ("bytes", u64), ("start", u64), ("end", u64), ("deviceId", u32), ("contextId", u32),
                ("streamId", u32), ("correlationId", u32), ("runtimeCorrelationId", u32), ("pad", u32),
                ("reserved0", ct.c_void_p), ("graphNodeId", u64), ("graphId", u32), ("channelID", u32),
                ("channelType", u32), ("isDeviceLaunched", u8), ("pad2", u8 * 3), ("copyCount", u64)]


class ActivityMemset4(ct.Structure):
    _pack_ = 1
    _fields_ = [("kind", u32), ("value", u32), ("bytes", u64), ("start", u64), ("end", u64),
                ("deviceId", u32), ("contextId", u32), ("streamId", u32), ("correlationId", u32),
                ("flags", u16), ("memoryKind", u16), ("pad", u32), ("reserved0", ct.c_void_p),
                ("graphNodeId", u64), ("graphId", u32), ("channelID", u32), ("channelType", u32),
                ("isDeviceLaunched", u8), ("pad2", u8 * 3)]


MIRRORS = {"CUpti_ActivityMemcpy6": ActivityMemcpy6, "CUpti_ActivityMemset4": ActivityMemset4}


class ActivityMemcpyKind(enum.IntEnum):   # CUpti_ActivityMemcpyKind
    UNKNOWN = 0
    HTOD = 1
    DTOH = 2
    HTOA = 3
    ATOH = 4
    ATOA = 5
    ATOD = 6
    DTOA = 7
    DTOD = 8
    HTOH = 9
    PTOP = 10


class ActivityMemoryKind(enum.IntEnum):   # CUpti_ActivityMemoryKind
    UNKNOWN = 0
    PAGEABLE = 1
    PINNED = 2
    DEVICE = 3
    ARRAY = 4
    MANAGED = 5
    DEVICE_STATIC = 6
    MANAGED_STATIC = 7


def dtype(struct):
    """The record's numpy dtype, as cupti-python exposes it (field names as in the header)."""
    import numpy as np

    return np.dtype(struct)


def memcpy6(corr: int, copy_kind: int, nbytes: int, start: int, end: int, *, src: int = 1, dst: int = 3,
            graph_id: int = 0, device: int = 0, stream: int = 7) -> bytes:
    r = ActivityMemcpy6(kind=KIND_MEMCPY, copyKind=copy_kind, srcKind=src, dstKind=dst, bytes=nbytes,
                        start=start, end=end, deviceId=device, contextId=1, streamId=stream,
                        correlationId=corr, runtimeCorrelationId=corr + 1000, graphId=graph_id,
                        graphNodeId=graph_id and 77, copyCount=1)
    return bytes(r)


def memset4(corr: int, nbytes: int, start: int, end: int, *, memory: int = 3, graph_id: int = 0,
            device: int = 0, stream: int = 7, value: int = 0) -> bytes:
    r = ActivityMemset4(kind=KIND_MEMSET, value=value, bytes=nbytes, start=start, end=end, deviceId=device,
                        contextId=1, streamId=stream, correlationId=corr, memoryKind=memory,
                        graphId=graph_id, graphNodeId=graph_id and 78)
    return bytes(r)
