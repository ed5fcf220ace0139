"""Frozen records the daemon gets from an agent (already validated by ``server.py``).

All times are CLOCK_MONOTONIC nanoseconds of the target's host (the agent converts CUPTI /
ROCm timestamps with its clock calibration). Strings are as ``server.py`` left them: control
characters escaped, frame files and names cut to ``validate.MAX_FRAME_FILE`` / ``MAX_FRAME_NAME``.
Slotted: up to 250k records wait in a server's queue, a ``__dict__`` each would double that.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

class JoinKind(str, enum.Enum):
    """How a session's GPU records find their launch (daemon/join/gpujoin.py): a vendor declares
    which it supports (inject/channel/gpu ``VENDORS``), ``pick_join`` picks one, the joiner builds it."""
    ORDER = "order"               # LaunchOrderJoin: by launch order and grid/block, no API records
    API_RECORDS = "api_records"   # ApiRecordJoin: exact, through API records (tid, interval, correlation)


PyFrame = tuple[str, str, int]          # (file, function/qualname, line)
# a sample's frame may also name a module call: (file, qualname, line, attribute path, class)
SampleFrame = PyFrame | tuple[str, str, int, str, str]


@dataclass(frozen=True, slots=True)
class AgentHello:
    pid: int
    tid: int
    python: tuple[int, int, int]
    executable: str


@dataclass(frozen=True, slots=True)
class PySample:
    tid: int
    t_ns: int
    frames: tuple[SampleFrame, ...]      # outermost first
    truncated: bool = False              # deeper than the agent's max_depth: outermost cut


@dataclass(frozen=True, slots=True)
class KernelRecord:
    name: str
    start_ns: int
    end_ns: int
    device: int
    stream: int
    correlation_id: int
    grid: tuple[int, int, int] = (0, 0, 0)
    block: tuple[int, int, int] = (0, 0, 0)
    graph_id: int = 0                    # non-zero: launched by a CUDA graph (all of one replay share
    graph_node_id: int = 0               # the launch's correlation id); the node, stable over replays

    @property
    def duration_ns(self) -> int:
        return self.end_ns - self.start_ns


@dataclass(frozen=True, slots=True)
class ApiRecord:
    domain: str                          # "runtime" | "driver" | "hip"
    name: str
    tid: int
    start_ns: int
    end_ns: int
    correlation_id: int
    cbid: int = 0


@dataclass(frozen=True, slots=True)
class MemcpyRecord:
    """A GPU copy or memset (CUPTI MEMCPY / MEMSET activity)."""
    kind: str                            # "HtoD" | "DtoH" | "DtoD" | "HtoH" | "PtoP" | "memset" | "other"
    bytes: int
    start_ns: int
    end_ns: int
    device: int
    stream: int
    correlation_id: int
    memory: str = ""                     # copies "Device -> Pinned", memsets "Device"; "" when not sent
    graph_id: int = 0                    # non-zero: a node of a CUDA graph (joined to its graph launch)

    @property
    def duration_ns(self) -> int:
        return self.end_ns - self.start_ns


@dataclass(frozen=True, slots=True)
class SyncRecord:
    type: str                            # "event" | "stream" | "context" | "stream_wait_event" | "other"
    start_ns: int
    end_ns: int
    stream: int
    correlation_id: int


@dataclass(frozen=True, slots=True)
class Note:
    level: str                           # "info" | "warning" | "error"
    message: str
    t_ns: int = 0


@dataclass(frozen=True, slots=True)
class AgentStats:
    samples: int
    sample_hz: float
    sample_cost_us: float
    dropped: dict = field(default_factory=dict)
    gpu: dict = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class AgentFlushed:
    """The agent's answer to the daemon's flush request `id` (a window's edge): every record of
    GPU activity completed by `t_ns` (CLOCK_MONOTONIC, when it flushed) came before this one."""
    id: int
    t_ns: int


HloOp = tuple[str, str, int, str]       # (op_name, source_file, source_line, function); "" / 0 if unknown


@dataclass(frozen=True, slots=True)
class HloKernel:
    name: str                            # HLO instruction name (fusion, custom-call, ...)
    opcode: str
    ops: tuple[HloOp, ...]               # distinct original operators it was fused from


@dataclass(frozen=True, slots=True)
class HloMapRecord:
    """One part of a compiled XLA module's source map (``inject/agent/jaxmeta.py``)."""
    module_id: str                       # executable fingerprint (or an agent-local id)
    module: str                          # HLO module name, e.g. "jit_step"
    platform: str                        # "cpu" | "cuda" | "rocm" | "" (unknown)
    part: int
    parts: int
    site: tuple[PyFrame, ...]            # Python call site that compiled it (empty: before attach)
    kernels: tuple[HloKernel, ...]       # in schedule order


@dataclass(frozen=True, slots=True)
class CompileRecord:
    """A ``jax.monitoring`` compile duration event on the thread that compiled."""
    event: str                           # "/jax/core/compile/backend_compile_duration", ...
    fun_name: str                        # "jit(step)"
    t_ns: int
    duration_ns: int
    tid: int
    frames: tuple[PyFrame, ...]          # user call site, outermost first (JAX frames cut)


@dataclass(frozen=True, slots=True)
class InductorRecord:
    """One part of what ties a torch.compile (Inductor) wrapper module to the model's source
    (``inject/agent/inductor.py``); the parts of a module are joined by ``daemon/join/compiled.py``."""
    path: str                            # the generated wrapper's file, as the target names it
    part: int
    parts: int
    traces: tuple[str, ...]              # distinct FX stack_trace strings
    regions: tuple[tuple[int, int], ...]  # (first wrapper line, index into the module's traces)
    nodes: tuple[tuple[str, str, int, str], ...]   # post-grad FX node -> (file, line, function)
    lines: tuple[tuple[int, str], ...]   # (line number, text) of the wrapper's comments and call body


AgentRecord = (PySample | KernelRecord | ApiRecord | MemcpyRecord | SyncRecord | Note | AgentStats | AgentHello
               | HloMapRecord | CompileRecord | InductorRecord)
