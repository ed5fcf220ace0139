"""stacklens.bpf — eBPF probes attached to a running process by PID (BCC).

Requires root (CAP_BPF, CAP_PERFMON, CAP_SYS_PTRACE). Importing this package has no side effects
and does not import bcc; ProbeSession.attach() does. Reading CPython from outside without BPF
(the interpreter, its threads, symbolizing code objects) is pystacks/, which imports nothing here.
"""

from stacklens.records.events import Event
from stacklens.bpf.report import AttachReport, LibraryAttach
from stacklens.bpf.attach import ProbeConfig
from stacklens.bpf.session import ProbeSession

__all__ = ["ProbeSession", "ProbeConfig", "AttachReport", "Event", "LibraryAttach"]
