"""Frame format between the agent and the daemon: 4-byte big-endian length + payload.

A payload is a UTF-8 JSON object, or — for CUPTI activity buffers shipped as CUPTI filled them —
a raw frame: RAW_MAGIC, a 4-byte big-endian header length, a JSON header, then the body.

Raw CUPTI buffers (the agent's default GPU path; no Python object per record in the target):
- once, before the first buffer, a JSON message ``{"t": "cupti_layout", "kinds": {code: {"rec":
  "kernel"|"memcpy"|"memset", "size": record bytes, "fields": {field: [offset, fmt]}}},
  "copy_kinds": {code: "HtoD"|"DtoH"|"DtoD"|"HtoH"|"PtoP"}}`` taken from cupti-python's record
  dtypes (fmt: one struct letter of B H I Q b h i q, little-endian). Fields per rec:
  kernel: kind start end device_id stream_id correlation_id grid_x grid_y grid_z block_x block_y
  block_z name (a pointer into the target: the daemon reads the string from the target's
  memory) [graph_id]; memcpy: kind copy_kind bytes start end device_id stream_id correlation_id
  [src_kind dst_kind graph_id]; memset: kind bytes start end device_id stream_id correlation_id
  [memory_kind graph_id]. Optional: ``"memory_kinds": {code: one of RAW_MEMORY_KINDS}`` (the
  CUpti_ActivityMemoryKind names of src_kind / dst_kind / memory_kind; a code not named is
  "Unknown").
- per completed buffer, a raw frame with header ``{"t": "cupti_raw", "off_ns": CLOCK_MONOTONIC
  minus CUPTI clock, "mode": "sizes"|"offsets", "n_offs": N, "align": A}`` and body = N
  little-endian uint32 record offsets (mode "offsets", from cuptiActivityGetNextRecord), then the
  buffer's valid bytes. In mode "sizes" records follow each other: the next record starts at
  align_up(offset + layout size of this record's kind, A); a kind not in the layout ends the walk.
- once the size walk is verified (the first buffers travel as raw frames with offsets), a buffer
  stays where CUPTI filled it and only ``{"t": "cupti_ref", "h": the raw header, "a": address,
  "n": valid bytes}`` travels: the daemon reads the bytes from the target's memory
  (/proc/PID/mem), parses them as it parses a raw frame, and answers ``{"t": "free", "a":
  [addresses]}`` (also for a reference it could not read), after which the agent reuses the
  buffer. The target copies nothing and writes no bulk bytes to the socket. At most 64 buffers
  (``max_raw_bytes``) are out at once; beyond that a buffer is copied into a raw frame.
Shared by both sides as constants only; the daemon validates every field it receives
(``stacklens.inject.channel.messages``, ``stacklens.inject.channel.gpu.cupti``) and never executes
anything the target sends.
"""

import json
import struct

VERSION = 1
MAX_FRAME = 1 << 20          # bytes of one JSON message; bigger frames are a protocol error
MAX_RAW_FRAME = 3 << 20      # bytes of one raw frame (a 1 MiB CUPTI buffer + its offsets + header)
MAX_STACK_DEPTH = 256
HEADER = struct.Struct(">I")
RAW_MAGIC = b"SLRB"
RAW_FORMATS = "BHIQbhiq"
# fields of the cupti_layout per record type: required (the first is always "kind"), then optional
RAW_FIELDS = {
    "kernel": ("kind", "start", "end", "device_id", "stream_id", "correlation_id", "grid_x", "grid_y", "grid_z",
               "block_x", "block_y", "block_z", "name"),
    "memcpy": ("kind", "copy_kind", "bytes", "start", "end", "device_id", "stream_id", "correlation_id"),
    "memset": ("kind", "bytes", "start", "end", "device_id", "stream_id", "correlation_id"),
}
RAW_OPTIONAL_FIELDS = {"kernel": ("graph_id", "graph_node_id"), "memcpy": ("src_kind", "dst_kind", "graph_id"),
                       "memset": ("memory_kind", "graph_id")}
RAW_COPY_KINDS = ("HtoD", "DtoH", "DtoD", "HtoH", "PtoP")
# CUpti_ActivityMemoryKind, as torch.profiler names them ("Memcpy DtoH (Device -> Pinned)")
RAW_MEMORY_KINDS = ("Unknown", "Pageable", "Pinned", "Device", "Array", "Managed", "Device Static",
                    "Managed Static")


def encode(msg: dict) -> bytes:
    data = json.dumps(msg, separators=(",", ":"), ensure_ascii=False).encode("utf-8", "replace")
    return HEADER.pack(len(data)) + data


def decode_all(data) -> tuple[list, int]:
    """The complete JSON frames at the start of data (what encode() wrote, concatenated) and how
    many bytes they took; a partial frame at the end is left. For tests and tools: the two ends
    of a live connection validate as they read (Channel._parse, stacklens.inject.channel.server)."""
    msgs, i = [], 0
    while i + 4 <= len(data):
        n = HEADER.unpack_from(data, i)[0]
        if i + 4 + n > len(data):
            break
        msgs.append(json.loads(bytes(data[i + 4:i + 4 + n])))
        i += 4 + n
    return msgs, i


def raw_prefix(header: dict, body_len: int) -> bytes:
    """What goes before a raw frame's body: length, magic, header length, JSON header."""
    head = json.dumps(header, separators=(",", ":")).encode()
    return HEADER.pack(len(RAW_MAGIC) + 4 + len(head) + body_len) + RAW_MAGIC + HEADER.pack(len(head)) + head


def encode_raw(header: dict, *body) -> bytes:
    """A raw frame: the prefix, then the body parts as they are."""
    return b"".join((raw_prefix(header, sum(len(b) for b in body)),) + body)
