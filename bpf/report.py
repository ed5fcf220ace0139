"""What an attach did: libraries and probes per process (ProbeSession.attach's report)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class LibraryAttach:
    path: str
    role: str            # "cuda" | "hip" | "torch"
    probes: int          # offsets attached in this file
    missing: tuple[str, ...] = ()  # probed symbols the file does not export
    # (probe symbol, export it attached to), one per attach point: cuCtxSynchronize attaches to
    # cuCtxSynchronize and cuCtxSynchronize_v2 where the file exports both (bpf/spec.py)
    sites: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class AttachReport:
    pid: int
    libraries: tuple[LibraryAttach, ...]
    probes_attached: int
    cpu_sampling_hz: int
    attach_s: float
    notes: tuple[str, ...] = ()
    method: str = "uprobe_multi"   # or "perf_event" (fallback on kernels without uprobe_multi)
    python_stacks: bool = False    # BPF reads the target's Python stacks (a supported CPython)
