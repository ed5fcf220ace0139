"""How GPU activity records find the BPF calls that issued them: one interface, two ways.

Pure (no privilege, no I/O); runs on the session's aggregation thread, inside the join.

A `GpuJoin` takes the BPF launches and copy/memset calls (each already given its path by the
`Joiner`) and the agent's CUPTI records, and says, per record, which call it belongs to by calling
the `Charges` it was built with (the `Joiner`, which owns the tree). It never touches the tree.
Two implementations, chosen once per session (`ProcessSession.join_kind`, a `records.agent.JoinKind`) by `inject/channel/gpu.pick_join`
from the GPU vendor's declared joins (`inject/channel/gpu.VENDORS`) and the agent's configuration:
- `ApiRecordJoin` (daemon/join/apijoin.py, agent `gpu_api_records=True`): exact, through CUPTI API
  records (thread id + host interval, then the correlation id);
- `LaunchOrderJoin` (daemon/join/orderjoin.py, the default): by launch order and grid/block, without
  API records.
Both count what they could not join through `Charges` (kernel unseen, launch dropped, copy
dropped), so the `Joiner`'s statistics mean the same under either.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from stacklens.cct import Frame
from stacklens.records.agent import ApiRecord, KernelRecord, MemcpyRecord

Path = tuple[Frame, ...]


@dataclass(slots=True)
class CopyCall:
    """A BPF copy or memset call waiting for its CUPTI record: the call's path (… → api:…) and
    what the call itself said it moves (`nbytes` of `metric`), charged only if no record claims
    it (`Charges.copy_dropped`), so every byte is counted once."""
    ktime_ns: int
    path: Path
    nbytes: int
    kind: str                        # "memcpy" | "memset"

    @property
    def metric(self) -> str:
        return "memset_bytes" if self.kind == "memset" else "copy_bytes"


class LaunchEvent(Protocol):
    """What a join reads of a BPF launch or copy event (`records.events.Event`)."""
    kind: str
    tid: int
    ktime_ns: int

    @property
    def args(self) -> dict: ...


class Charges(Protocol):
    """Where a join's verdicts go (implemented by `Joiner`, charged by `GpuCharges`, daemon/join/charges.py)."""

    def kernel(self, path: Path, rec: KernelRecord) -> None:
        """A kernel record joined to the path of its launch."""

    def kernel_unseen(self, rec: KernelRecord) -> None:
        """A kernel record no launch claimed: charged under `[launch not seen]`, counted."""

    def kernel_lost(self) -> None:
        """Kernel records that waited too long for their launch (dropped, counted)."""

    def launch_dropped(self) -> None:
        """A launch no record will claim (never reported by CUPTI, or too old)."""

    def copy(self, path: Path, rec: MemcpyRecord) -> None:
        """A copy/memset record joined to its call's path (or its graph launch's)."""

    def copy_unseen(self, rec: MemcpyRecord) -> None:
        """A copy/memset record no call claimed: under `[copy call not seen]`, counted."""

    def copy_dropped(self, call: CopyCall) -> None:
        """A call no record claimed: the bytes it asked for are all that is known of it."""


class GpuJoin(Protocol):
    """One way of joining GPU records to BPF calls (the module docstring)."""

    def on_launch(self, ev: LaunchEvent, path: Path) -> None:
        """A kernel or graph launch (`ev.kind` "launch" | "graph") whose path is `path`."""

    def on_copy_call(self, ev: LaunchEvent, call: CopyCall) -> None: ...

    def on_api(self, rec: ApiRecord) -> None: ...

    def on_kernel(self, rec: KernelRecord) -> None: ...

    def on_copy(self, rec: MemcpyRecord) -> None: ...

    def on_enabled(self, t_ns: int) -> None:
        """The agent's GPU collector was (re)enabled at `t_ns` (CLOCK_MONOTONIC)."""

    def expire(self, now_ns: int) -> None:
        """Join what has settled; drop what waited too long (the session calls it every 0.2 s)."""

    def finish(self) -> None:
        """At detach: join or drop everything still waiting."""

    def settle(self) -> None:
        """At a window's edge, once the agent's flush has arrived: join every record received
        (none waits for others to arrive); launches and calls still waiting stay."""

    def waiting_launches(self) -> int:
        """Launches still waiting for a record that will now never come (a window's `unjoined`)."""

    def stats(self) -> dict[str, int]:
        """The join's own counters, merged into `JoinStats.extra`."""
