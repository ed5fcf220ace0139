"""A window's edges on a held session, taken exactly (`ProcessSession.edge`, daemon/windows.py).

An edge at time t asks the agent for a flush (its answer, `AgentFlushed`, comes after every GPU
record of activity completed by then) and is served by the session's aggregation thread once the
BPF ring has been read past t and that answer has been joined. Until then the gate holds back
what belongs after the edge: BPF events stamped after t, and agent records after the answer. So
the edge's snapshot holds exactly what happened up to t, however long the wait, and nothing is
lost: the held events are joined once it is taken. An edge that cannot be reached within its
deadline is taken with what has been joined, and says what it did not wait for.

`EdgeGate` is pure bookkeeping on the aggregation thread, no I/O; the held lists grow only while
an edge waits. `HeldEdges` asks for edges and takes them on the session.
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import time
from dataclasses import dataclass, field

from stacklens.records.agent import AgentFlushed

log = logging.getLogger(__name__)


@dataclass
class Edge:
    t_ns: int                       # CLOCK_MONOTONIC, the clock BPF stamps with
    flush_id: int | None            # the agent's flush request; None: no agent to wait for
    timeout_s: float                # after this long it is taken as it is
    missing_agent: bool = False     # an agent was wanted but was not connected to ask
    agent_done: bool = False        # its flush answer has been joined
    future: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)

    def __post_init__(self) -> None:
        self.agent_done = self.flush_id is None
        self.deadline = time.monotonic() + self.timeout_s

    def reached(self, read_up_to_ns: int) -> bool:
        return self.agent_done and read_up_to_ns >= self.t_ns

    def missing(self, read_up_to_ns: int, ended: bool = False) -> list[str]:
        """What it was taken without, one phrase each (empty: exact). A session that `ended`
        (its process exited) has read and joined all there will be."""
        out = []
        if self.missing_agent:
            out.append("the agent was not connected to flush its GPU records")
        if not ended and read_up_to_ns < self.t_ns:
            out.append(f"the BPF ring was not read up to it within {self.timeout_s:g}s")
        if not ended and not self.agent_done:
            out.append(f"the agent did not answer its flush within {self.timeout_s:g}s")
        return out


class EdgeGate:
    """The pending edges (first come, first served) and what is held back behind the first."""

    def __init__(self) -> None:
        self.pending: collections.deque[Edge] = collections.deque()
        self._bpf: list = []
        self._agent: list = []

    def bpf(self, events: list) -> list:
        """The events to join now; those stamped after the first pending edge are held."""
        if self._bpf:
            events, self._bpf = self._bpf + events, []
        if not self.pending or not events:
            return events
        t = self.pending[0].t_ns
        if max(ev.ktime_ns for ev in events) <= t:
            return events
        now = [ev for ev in events if ev.ktime_ns <= t]
        self._bpf = [ev for ev in events if ev.ktime_ns > t]
        return now

    def agent(self, records: list) -> list:
        """The agent records to join now: up to and including the first pending edge's flush
        answer; the rest are held."""
        if self._agent:
            records, self._agent = self._agent + records, []
        if not self.pending:
            return records
        edge = self.pending[0]
        if edge.agent_done:
            self._agent = records
            return []
        for i, rec in enumerate(records):
            if type(rec) is AgentFlushed and rec.id >= edge.flush_id:
                edge.agent_done = True
                self._agent = records[i + 1:]
                return records[:i + 1]
        return records

    def due(self, read_up_to_ns: int) -> Edge | None:
        """The first pending edge if it can be taken now (reached, or past its deadline)."""
        if not self.pending:
            return None
        edge = self.pending[0]
        if edge.reached(read_up_to_ns) or time.monotonic() >= edge.deadline:
            return edge
        return None

    def release(self) -> tuple[list, list]:
        """Everything held (the session is ending): (BPF events, agent records)."""
        out = (self._bpf, self._agent)
        self._bpf, self._agent = [], []
        return out


class HeldEdges:
    """A held session's edges (`ProcessSession.edge`): asked by a window's thread, taken on the
    session's aggregation thread (`take_due`, and `end` when the session ends), with the gate
    holding back what comes after the first. `session`: its joiner, agent, desk and read mark."""

    def __init__(self, session) -> None:
        self.s = session
        self.gate = EdgeGate()
        self.agent_flushed = 0    # the newest flush request whose answer (and records before it) joined

    def ask(self, timeout_s: float, t_ns: int):
        s = self.s
        ask = getattr(s.agent, "request_flush", None) if s.agent is not None else None
        fid = ask() if ask is not None else None
        edge = Edge(t_ns, fid, timeout_s, missing_agent=s.want_agent and fid is None)
        with s.desk.lock:
            queued = s.desk.open
            if queued:
                self.gate.pending.append(edge)
        if not queued:        # the session has ended: everything it read is joined
            s.joiner.settle()
            return s.joiner.snapshot(), []
        return edge.future.result(timeout=timeout_s + 60)

    def join_agent(self, records: list) -> None:
        for rec in records:
            if type(rec) is AgentFlushed:   # every record before it is joined now
                self.agent_flushed = max(self.agent_flushed, rec.id)
                self.s.joiner.settle()
            else:
                self.s.joiner.on_agent(rec)

    def take_due(self) -> None:
        """On the aggregation thread: the first edge, if it can be taken now."""
        edge = self.gate.due(self.s.read_up_to_ns)
        if edge is not None:
            self._take(edge)

    def _take(self, edge: Edge, ended: bool = False) -> None:
        """The edge's snapshot, then what was held back is let go."""
        s = self.s
        try:
            s.joiner.settle()
            s.refresh_read_notes()
            edge.future.set_result((s.joiner.snapshot(), edge.missing(s.read_up_to_ns, ended)))
        except Exception as e:  # noqa: BLE001 — the window's client gets the error
            edge.future.set_exception(e)
        finally:
            self.gate.pending.popleft()

    def end(self) -> None:
        """The session ends: what was held back is joined, and every edge still waiting is
        taken (the process exited: nothing more will come)."""
        s = self.s
        bpf, agent = self.gate.release()
        try:
            for ev in bpf:
                s.joiner.on_bpf(ev)
            self.join_agent(agent)
        except Exception:  # noqa: BLE001 — the edges below are still answered
            log.exception("session %d: joining what an edge held back", s.pid)
        with s.desk.lock:
            edges = list(self.gate.pending)
            self.gate.pending.clear()
        for edge in edges:
            self.gate.pending.append(edge)
            self._take(edge, ended=True)
