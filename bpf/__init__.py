"""stacklens.bpf — eBPF probes attached to a running process by PID (BCC).

Requires root (CAP_BPF, CAP_PERFMON, CAP_SYS_PTRACE). Importing this package has no side effects
and does not import bcc; ProbeSession.attach() does. The names below are loaded on first use, so
that a reader of one module (`stacklens dump` reads stacks through bpf/pysym.py) does not pay for
the attacher and the ring decoder (~0.2 s of imports).
"""

from __future__ import annotations

import importlib

_HOMES = {"ProbeSession": "stacklens.bpf.session", "ProbeConfig": "stacklens.bpf.attach",
          "AttachReport": "stacklens.bpf.report", "LibraryAttach": "stacklens.bpf.report",
          "Event": "stacklens.records.events"}


def __getattr__(name: str):
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'stacklens.bpf' has no attribute {name!r}")
    return getattr(importlib.import_module(home), name)


__all__ = ["ProbeSession", "ProbeConfig", "AttachReport", "Event", "LibraryAttach"]
