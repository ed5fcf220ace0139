"""Fakes behind the daemon's Protocols (EventSource, AgentSource) for unit tests only.

The integration tests in tests/bpf and tests/integration use the real probes and agent.
"""

from __future__ import annotations

import collections
import threading
import dataclasses
from dataclasses import dataclass, field

from stacklens.cct import Frame


@dataclass(frozen=True)
class FakeEvent:
    kind: str
    tid: int = 1
    ktime_ns: int = 0
    api: str = ""
    op_path: tuple = ()
    native_stack: tuple = ()
    py_stack: tuple = ()
    kernel_name: str = ""
    duration_ns: int = 0
    bytes: int = 0

    def with_duration(self, duration_ns: int) -> "FakeEvent":
        return dataclasses.replace(self, duration_ns=duration_ns)


class FakeProbes:
    """An EventSource fed by the test (`push`)."""

    def __init__(self, pid: int, **kw) -> None:
        self.pid = pid
        self.kw = kw
        self.q: collections.deque = collections.deque()
        self.attached = False
        self.detached = False
        self.cv = threading.Condition()
        self.waiting: list = []         # what in_flight() answers: calls entered, not returned

    def in_flight(self) -> list:
        return list(self.waiting)

    def attach(self):
        self.attached = True
        return type("Report", (), {"notes": ["fake probes attached"]})()

    def push(self, *events) -> None:
        with self.cv:
            self.q.extend(events)
            self.cv.notify_all()

    def poll(self, timeout_ms: int = 100, max_events: int = 1 << 20):
        with self.cv:
            if not self.q and timeout_ms:
                self.cv.wait(timeout_ms / 1000)
            n = min(max_events, len(self.q))
            out = [self.q.popleft() for _ in range(n)]
        return out

    def stats(self):
        return {"events": 0, "drops": 0}

    def detach(self) -> None:
        self.detached = True


def py(func: str, line: int, file: str = "train.py") -> Frame:
    return Frame.python(file, func, line)


def exiting_probes(process):
    """A FakeProbes class whose attach ends `process` (a Popen) in its first step and fails as
    the real probes do when the process is gone."""
    from stacklens.errors import NoSuchProcess

    class ExitingProbes(FakeProbes):
        on_phase = None

        def attach(self):
            self.on_phase("compiling BPF")
            process.kill()
            process.wait()
            raise NoSuchProcess(f"no process {self.pid}; check the PID with `ps`")   # what the probes say

    return ExitingProbes
