"""Strict parsing of the agent's JSON messages into records (spec: ``inject/agent/wire.py``).

Pure: no privilege, no I/O. Everything the agent sends is hostile: strict types and ranges per
message kind, unknown kinds rejected (``ProtocolError``), strings escaped (control characters,
``textsafe.py``) and frame strings cut to a length (``validate.MAX_FRAME_FILE`` /
``MAX_FRAME_NAME``, counted ``truncated_strings``). GPU messages go to the decoder of the vendor
that declares them (``gpu.VENDORS``, ``gpu.route``).
"""

from __future__ import annotations

from stacklens.inject.agent import wire
from stacklens.inject.channel.gpu import Connection, route
from stacklens.inject.channel.inductor import parse_inductor
from stacklens.inject.channel.validate import MAX_FRAME_FILE, MAX_FRAME_NAME, MAX_INT, MAX_STR, ProtocolError
from stacklens.inject.channel.validate import check_int as _int, check_list as _list, check_num as _num
from stacklens.inject.channel.validate import check_row as _row, check_text as _str, clip_text
from stacklens.records.agent import AgentFlushed, AgentStats, CompileRecord, HloKernel, HloMapRecord, Note, PySample

LEVELS = ("info", "warning", "error")
MAX_HLO_PARTS = 4096
MAX_HLO_OPS = 64
# string limits of the JAX records; the agent cuts to the same (inject/agent/jaxmeta.py LIMITS)
HLO_LIMITS = {"id": 128, "module": 512, "platform": 32, "instr": 1024, "opcode": 64, "op_name": 2048,
              "file": MAX_STR, "func": 1024, "event": 128, "fun_name": 256}

KNOWN_KINDS = ("samples", "kernel", "api", "memcpy", "sync", "note", "stats", "hlo", "compile", "bye",
               "cupti_layout", "cupti_raw", "cupti_ref", "inductor", "flushed")
FRAME_BYTES = 180           # a (file, name, line) tuple, two str headers, the line int


def _counts(v) -> dict:
    """Counters/gauges of a stats message: bounded keys, finite numbers; ints may be negative
    (e.g. the CUPTI collector's clock_offset_ns, CLOCK_MONOTONIC minus the CUPTI clock)."""
    if type(v) is not dict or len(v) > 32:
        raise ProtocolError("bad counters")
    return {_str(k, 64): (_num(x) if type(x) is float else _int(x, -MAX_INT)) for k, x in v.items()}


def _pyframes(v, maxlen=wire.MAX_STACK_DEPTH, counts=None, modules=False) -> tuple:
    """Python frames (file, name, line): strings cut and escaped (``clip_text``); ``counts``
    (a Counter) gets the cuts and the frames' estimated bytes (``"bytes"``). With ``modules``
    a frame may also be (file, name, line, attribute path, class): a module's forward
    (``inject/agent/sampler.py``), its two names cut and escaped the same way."""
    out = tuple(_pyframe(x, counts, modules) for x in _list(v, maxlen))
    if counts is not None:
        counts["bytes"] += sum(sum(len(s) for s in f if type(s) is str) for f in out) + FRAME_BYTES * len(out)
    return out


def _pyframe(x, counts, modules: bool) -> tuple:
    f = _row(x, 5) if modules and type(x) is list and len(x) == 5 else _row(x, 3)
    frame = (clip_text(f[0], MAX_FRAME_FILE, counts=counts), clip_text(f[1], MAX_FRAME_NAME, counts=counts),
             _int(f[2], 0, 1 << 31))
    if len(f) == 5:
        frame += (clip_text(f[3], MAX_FRAME_NAME, counts=counts), clip_text(f[4], MAX_FRAME_NAME, counts=counts))
    return frame


def _hlo(msg) -> HloMapRecord:
    parts = _int(msg.get("parts"), 1, MAX_HLO_PARTS)
    kernels = []
    L = HLO_LIMITS
    for k in _list(msg.get("k")):
        name, opcode, ops = _row(k, 3)
        kernels.append(HloKernel(_str(name, L["instr"]), _str(opcode, L["opcode"]),
                                 tuple((_str(o[0], L["op_name"]), _str(o[1], L["file"]), _int(o[2], 0, 1 << 31),
                                        _str(o[3], L["func"]))
                                       for o in (_row(x, 4) for x in _list(ops, MAX_HLO_OPS)))))
    return HloMapRecord(_str(msg.get("id"), L["id"]), _str(msg.get("module"), L["module"]),
                        _str(msg.get("platform"), L["platform"]), _int(msg.get("part"), 0, parts - 1), parts,
                        _pyframes(msg.get("site")), tuple(kernels))


def parse_message(msg, counts=None, conn: Connection | None = None) -> list:
    """One decoded JSON message -> records. Raises ProtocolError on anything unexpected.
    ``counts`` (a Counter, optional): strings cut (``truncated_strings``) and the estimated bytes
    of the samples' frames (``bytes``). GPU messages go to the decoder of the vendor declaring
    their kind (``gpu.route``), with ``conn``, the agent connection's state (a fresh one if None:
    rows need none)."""
    if type(msg) is not dict:
        raise ProtocolError("not an object")
    t = msg.get("t")
    if t == "samples":
        stacks = []
        for st in _list(msg.get("stacks"), 5000):
            stacks.append(_pyframes(st, counts=counts, modules=True))
        out = []
        for s in _list(msg.get("s")):
            tid, t_ns, idx, trunc = _row(s, 4)
            _int(idx, 0, len(stacks) - 1)
            out.append(PySample(_int(tid, 0, 1 << 31), _int(t_ns), stacks[idx], bool(_int(trunc, 0, 1))))
        return out
    if conn is None:
        conn = Connection(0)
    vendor = route(t, conn)
    if vendor is not None:              # GPU activity: rows, CUPTI's layout and buffers (inject/channel/gpu)
        return vendor.decoder.decode(t, msg, conn)
    if t == "note":
        level = msg.get("level")
        if level not in LEVELS:
            raise ProtocolError("bad note level")
        return [Note(level, _str(msg.get("msg"), 2000), _int(msg.get("t_ns", 0)))]
    if t == "stats":
        gpu = msg.get("gpu", {})
        return [AgentStats(_int(msg.get("samples")), _num(msg.get("sample_hz")),
                           _num(msg.get("sample_cost_us")), _counts(msg.get("dropped", {})), _counts(gpu))]
    if t == "hlo":
        return [_hlo(msg)]
    if t == "compile":
        out = []
        for r in _list(msg.get("r")):
            event, fun, t_ns, dur, tid, frames = _row(r, 6)
            if type(event) is not str or not event.startswith("/jax/"):
                raise ProtocolError("bad compile event")
            out.append(CompileRecord(_str(event, HLO_LIMITS["event"]), _str(fun, HLO_LIMITS["fun_name"]), _int(t_ns),
                                     _int(dur), _int(tid, 0, 1 << 31),
                                     _pyframes(frames)))
        return out
    if t == "inductor":                 # torch.compile's generated modules (inject/channel/inductor.py)
        return [parse_inductor(msg)]
    if t == "flushed":                  # the answer to a flush request (a window's edge)
        return [AgentFlushed(_int(msg.get("id"), 0, MAX_INT), _int(msg.get("t_ns")))]
    if t == "bye":
        return []
    raise ProtocolError(f"unknown message kind {str(t)[:32]!r}")


__all__ = ["HLO_LIMITS", "KNOWN_KINDS", "parse_message"]
