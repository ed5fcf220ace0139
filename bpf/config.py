"""ProbeConfig: what an attach probes and how (the attacher's parts read it: bpf/attach.py,
bpf/loader.py, bpf/scan.py). Pure data: no privilege, no I/O beyond the environment variables
some defaults read (STACKLENS_ALL_OPS, STACKLENS_AUTOGRAD, STACKLENS_NATIVE_UNWIND).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from stacklens.bpf.spec import DEFAULT_SPEC


@dataclass(frozen=True)
class ProbeConfig:
    cpu_sample_hz: int = 99
    ops: bool = True
    gpu: bool = True
    native_stacks: bool = True
    python_stacks: bool = True
    spec_path: str = str(DEFAULT_SPEC)
    ringbuf_pages: int = 4096          # 16 MiB
    rescan_interval_s: float = 2.0     # look for libraries loaded after attach (0 = never)
    # Op selection (bpf/ops.py select_ops): by default every at::_ops::*::call except the view
    # and metadata ops of ops.VIEW_OPS; all_ops=True probes those too (also env STACKLENS_ALL_OPS=1,
    # for the CLI and the daemon); op_filter, a regex searched in op names, picks from every op.
    op_filter: str = ""
    all_ops: bool = field(default_factory=lambda: os.environ.get("STACKLENS_ALL_OPS", "") not in ("", "0"))
    force_fallback: bool = False       # per-probe perf-event uprobes even where uprobe_multi works
    # the forward→backward link (autograd.bpf.c, with the op probes); env STACKLENS_AUTOGRAD=0: off
    autograd: bool = field(default_factory=lambda: os.environ.get("STACKLENS_AUTOGRAD", "1") not in ("0", "no", "off"))
    # extra -D flags for pystack.h (e.g. -DSL_PY_STACKS=…), added after the ones attach() gets
    # from PythonStackReader for this target (layout, TLS offset, interpreter address)
    pystack_cflags: tuple[str, ...] = ()
    extra_cflags: tuple[str, ...] = ()  # more -D parameters (e.g. -DSL_BENCH_FANOUT=8 in benchmarks)
    # CPU samples also carry their registers and up to 16 KiB of stack, walked in user space with
    # the libraries' .eh_frame where frame pointers end (bpf/unwind.py): whole native stacks
    # through MKL/libpython (99.7-100% unbroken under ops on a torch loop) for 33-59 µs of CPU per
    # sample walked offline, 160 µs live on a loaded VM, less than symbolizing the frame-pointer
    # walk's garbage costs (docs/benchmarks/native-stacks.md). Opt-in (env STACKLENS_NATIVE_UNWIND=cfi,
    # for the CLI and the daemon) until the GPU safety matrix has run with it whole (docs/decisions.md)
    cfi_unwind: bool = field(default_factory=lambda: os.environ.get("STACKLENS_NATIVE_UNWIND", "") == "cfi")
    # compile only the parts the process can use now: GPU probes when it maps a GPU driver library,
    # operator probes when it maps libtorch_cpu (a pure-Python target: 5.9 s of BCC compile instead
    # of 10 s on the 2-vCPU machine). For one-shot profiles; a daemon keeps one program for all.
    only_mapped: bool = False
