"""GPU vendors: one collector + decoder pair each, and what each declares it supports.

Pure (no privilege, no I/O). A vendor is a collector in the agent's tree
(``inject/agent/gpu/<name>.py``: runs in the target, stdlib only, listed in that package's
``COLLECTORS`` with the libraries that pick it) and a decoder here (``inject/channel/gpu/<name>.py``:
turns what the collector sends into the typed records of ``records/agent.py``; hostile input). Its
``Vendor`` entry below declares which joins its records support and whether it ships raw buffers;
the session picks the join from that declaration (``pick_join``), never from a vendor's name.
The agent server hands every GPU message to the decoder of the vendor that declares its kind
(``route``; the decoder's ``MESSAGES``) through ``Vendor.decoder.decode(t, msg, conn)``: that is
the path production records take. ``conn`` (a ``Connection``) is what a decoder keeps of one agent
connection (its transport state, counters, the target's memory).
Adding a vendor: the two modules, a ``COLLECTORS`` row, a ``VENDORS`` entry.

How kernel / memcpy / memset records travel (wire format: ``inject/agent/wire.py``):
1. JSON rows (``kernel``, ``memcpy``, ``api``, ``sync``), built in the target: ROCm always, CUPTI
   through cupti-python (API records on, or no ctypes callbacks); decoded by ``rows.py``.
2. Raw buffer copies (``raw_buffers``; CUPTI): ``cupti_layout`` once, then each completed
   activity buffer copied into a raw frame; decoded by ``cupti.py`` with that layout.
3. Raw buffers read in place (``raw_buffers``; CUPTI): ``cupti_ref`` (address, length), the daemon
   reads the bytes from /proc/PID/mem (``cupti.NameReader``), decodes them as in 2, answers ``free``.
"""

from __future__ import annotations

import collections
import importlib
from dataclasses import dataclass, field

from stacklens.inject.agent.gpu import COLLECTORS, vendor_of
from stacklens.records.agent import JoinKind

MAX_FREE = 256              # addresses per "free" message back to the agent

# The GpuJoin implementations (daemon/join/gpujoin.py) a vendor may declare (records/agent.py):
# ORDER: LaunchOrderJoin, by launch order and grid/block, needs no API records but the
#        collector's enable time (stats enabled_at_ns) and kernels' grid/block;
# API_RECORDS: ApiRecordJoin, exact, through API records (thread id, interval, correlation id).
JOINS = tuple(JoinKind)


@dataclass(frozen=True)
class Vendor:
    name: str                  # GpuCollector.name; the module name of both halves
    joins: tuple[JoinKind, ...]   # the vendor's default first
    raw_buffers: bool          # ships activity buffers as bytes (copies or read in place), not only rows
    module: str = ""           # the decoder's module; "" is this package's ``<name>`` module

    @property
    def collector(self) -> str:
        """The collector's module, as the agent's ``_sub`` names it."""
        return f"gpu.{self.name}"

    @property
    def decoder_module(self) -> str:
        return self.module or f"{__name__}.{self.name}"

    @property
    def decoder(self):
        """The decoder module (imported on first use): ``MESSAGES``, the kinds it decodes, and
        ``decode(t, msg, conn) -> records``."""
        return importlib.import_module(self.decoder_module)


VENDORS: dict[str, Vendor] = {
    # CUPTI: kernel/copy activity alone by default (order join, raw buffers); API records on request
    "cupti": Vendor("cupti", joins=(JoinKind.ORDER, JoinKind.API_RECORDS), raw_buffers=True),
    # ROCm: HIP API records always on, kernels without grid/block, no enable time: exact join only
    "rocm": Vendor("rocm", joins=(JoinKind.API_RECORDS,), raw_buffers=False),
}

# The joins when no vendor library is mapped at attach (a collector, if any, starts later): the
# choice made before vendors declared theirs (CUPTI's).
DEFAULT_JOINS = (JoinKind.ORDER, JoinKind.API_RECORDS)


def vendor_for(libraries) -> Vendor | None:
    """The vendor whose collector the agent would pick for these mapped library paths (the
    agent's own rule, ``inject/agent/gpu.vendor_of``), or None."""
    name = vendor_of(libraries)
    return VENDORS.get(name) if name is not None else None


def pick_join(vendor: Vendor | None, api_records: bool) -> JoinKind:
    """The join for a session: the API-record join when asked for and supported, else the order
    join when supported, else the one join the vendor supports."""
    joins = vendor.joins if vendor is not None else DEFAULT_JOINS
    if api_records and JoinKind.API_RECORDS in joins:
        return JoinKind.API_RECORDS
    if not api_records and JoinKind.ORDER in joins:
        return JoinKind.ORDER
    return JoinKind(joins[0])


@dataclass(eq=False)
class Connection:
    """One agent connection as the decoders see it; the server makes one per connection.
    ``memory``: the target's memory (``cupti.NameReader``, set at the hello); ``counts``: the
    decoders' counters, added to the server's stats after each message (``"bytes"``, when set,
    is the estimated bytes of the records beyond their count); ``to_free``: addresses of buffers
    read in place, handed back to the agent (``replies``); ``state``: each vendor's own, by name;
    ``vendor``: the vendor this connection's collector turned out to be (the first message of a
    kind only one vendor declares), which then decodes the kinds several declare."""
    pid: int
    memory: object = None
    counts: collections.Counter = field(default_factory=collections.Counter)
    to_free: list = field(default_factory=list)
    state: dict = field(default_factory=dict)
    vendor: Vendor | None = None

    def replies(self) -> list[dict]:
        """The messages owed to the agent (``free``: at most MAX_FREE addresses each)."""
        out = []
        while self.to_free:
            out.append({"t": "free", "a": self.to_free[:MAX_FREE]})
            del self.to_free[:MAX_FREE]
        return out


def route(kind, conn: Connection | None = None) -> Vendor | None:
    """The vendor whose decoder takes messages of ``kind``, or None (not a GPU message). Kinds
    several vendors declare (JSON rows: every collector may send them) go to the connection's
    vendor once known, else to the first declaring vendor in ``VENDORS`` order; a kind only one
    vendor declares makes it the connection's vendor."""
    declaring = [v for v in VENDORS.values() if kind in v.decoder.MESSAGES]
    if not declaring:
        return None
    if conn is not None:
        if len(declaring) == 1:
            conn.vendor = declaring[0]
        if conn.vendor in declaring:
            return conn.vendor
    return declaring[0]


def collector_names() -> tuple[str, ...]:
    """The vendors of the agent's ``COLLECTORS`` table, in its order."""
    return tuple(row[0] for row in COLLECTORS)


__all__ = ["DEFAULT_JOINS", "JOINS", "VENDORS", "Connection", "Vendor", "collector_names", "pick_join", "route",
           "vendor_for"]
