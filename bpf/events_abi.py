"""ctypes mirrors of the C structs in bpf/programs/stacklens.h — each defined once, here.

tests/bpf/test_events_abi.py compiles a tiny C program with the header and checks every size
and offset against these classes.
"""

from __future__ import annotations

import ctypes as ct

SL_NARGS = 12
SL_BLOB = 64
SL_NAME = 128
SL_OP_DEPTH = 32  # default of -DSL_OP_DEPTH

SL_EV_API = 1
SL_EV_SAMPLE = 2
SL_EV_NAME = 3
SL_EV_NODE_NEW = 4
SL_EV_NODE_EVAL = 5

# indices of the per-CPU `counters` array
COUNTERS = (
    "events", "drops", "stack_errors", "op_overflow", "op_calls", "op_path_full",
    "pending_miss", "samples", "no_user_regs", "py_stack_errors", "lost_samples", "reserve_retry_ok",
    "ring_fallback", "native_stacks_reused", "stacks_in_map2", "stack_copies_skipped",
    "deep_stack_copies",
)
SL_NCOUNTERS = 17         # counters per target: counters[slot * SL_NCOUNTERS + i] (stacklens.h)
SL_STACK_IN_2 = 1 << 30   # a native stack id with this bit set is in `stacks2` (stacklens.h)
SL_STACK_INLINE = -4096   # the stack's addresses follow the event; `out` = their size in bytes


class SlSpec(ct.Structure):
    _fields_ = [
        ("nargs", ct.c_uint8),
        ("flags", ct.c_uint8),
        ("blob_arg", ct.c_int8),
        ("out_arg", ct.c_int8),
        ("str_arg", ct.c_int8),
        ("ref_arg", ct.c_int8),
        ("pad", ct.c_uint8 * 2),
        ("src", ct.c_uint8 * SL_NARGS),
    ]


class SlEvent(ct.Structure):
    _fields_ = [
        ("kind", ct.c_uint32),
        ("spec", ct.c_uint32),
        ("pid", ct.c_uint32),
        ("tid", ct.c_uint32),
        ("ktime_ns", ct.c_uint64),
        ("duration_ns", ct.c_uint64),
        ("op_hash", ct.c_uint64),
        ("op_depth", ct.c_uint32),
        ("stack_id", ct.c_int32),
        ("py_stack_id", ct.c_uint64),
        ("ret", ct.c_uint64),
        ("out", ct.c_uint64),
        ("caller", ct.c_uint64),
        ("bwd_node", ct.c_uint64),
        ("args", ct.c_uint64 * SL_NARGS),
        ("blob", ct.c_uint8 * SL_BLOB),
    ]


class SlNameEvent(ct.Structure):
    _fields_ = [
        ("kind", ct.c_uint32),
        ("spec", ct.c_uint32),
        ("pid", ct.c_uint32),
        ("tid", ct.c_uint32),
        ("handle", ct.c_uint64),
        ("ref", ct.c_uint64),
        ("name", ct.c_char * SL_NAME),
    ]


class SlOpEntry(ct.Structure):
    _fields_ = [
        ("sp", ct.c_uint64),
        ("ret", ct.c_uint64),
        ("hash", ct.c_uint64),
        ("op", ct.c_uint32),
        ("pad", ct.c_uint32),
    ]


SL_BWD_DEPTH = 4


class SlBwdEntry(ct.Structure):
    _fields_ = [("sp", ct.c_uint64), ("ret", ct.c_uint64), ("node", ct.c_uint64)]


class SlShadow(ct.Structure):
    _fields_ = [("depth", ct.c_uint32), ("bwd_depth", ct.c_uint32), ("bwd", SlBwdEntry * SL_BWD_DEPTH),
                ("new_node", ct.c_uint64), ("new_tag", ct.c_uint64 * 2),
                ("py_memo_sp", ct.c_uint64), ("py_memo_id", ct.c_uint64),
                ("e", SlOpEntry * SL_OP_DEPTH)]


class SlOpPath(ct.Structure):
    _fields_ = [("depth", ct.c_uint32), ("tgid", ct.c_uint32), ("ops", ct.c_uint32 * SL_OP_DEPTH)]


class SlOpSlot(ct.Structure):
    _fields_ = [("hash", ct.c_uint64), ("count", ct.c_uint64)]


class SlTarget(ct.Structure):
    _fields_ = [("slot", ct.c_uint32), ("tgid", ct.c_uint32), ("py_interp", ct.c_uint64),
                ("py_tls_off", ct.c_uint64)]


ABI_STRUCTS = {
    "sl_spec": SlSpec,
    "sl_event": SlEvent,
    "sl_name_event": SlNameEvent,
    "sl_op_entry": SlOpEntry,
    "sl_shadow": SlShadow,
    "sl_bwd_entry": SlBwdEntry,
    "sl_op_path": SlOpPath,
    "sl_op_slot": SlOpSlot,
    "sl_target": SlTarget,
}
