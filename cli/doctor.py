"""`stacklens doctor`: preflight of what attaching needs, with the fix for each failed check.

Reads procfs/sysfs only; loading a trivial BPF program needs root (or CAP_BPF + CAP_PERFMON).
Exit status 1 when any check fails. A check that does not apply (libcuda on a CPU job, Python
stacks in a process that is not Python) reads "n/a" and fails nothing.
"""

from __future__ import annotations

import os
import platform
import re
from dataclasses import dataclass
from pathlib import Path

from stacklens.introspect.procfs import ProcFS


@dataclass(frozen=True)
class Check:
    name: str
    ok: bool
    detail: str
    fix: str = ""
    applies: bool = True   # False: nothing to check here ("n/a"), whatever `ok` says

    @property
    def mark(self) -> str:
        return "n/a " if not self.applies else "ok  " if self.ok else "FAIL"

    @property
    def failed(self) -> bool:
        return self.applies and not self.ok


def _kernel_version() -> tuple[int, int]:
    m = re.match(r"(\d+)\.(\d+)", platform.release())
    return (int(m.group(1)), int(m.group(2))) if m else (0, 0)


def system_checks() -> list[Check]:
    checks = []
    kv = _kernel_version()
    checks.append(Check("kernel", kv >= (5, 8), platform.release(), "eBPF ring buffers need Linux >= 5.8"))
    checks.append(
        Check(
            "uprobe_multi",
            kv >= (6, 6),
            "one link for thousands of op probes" if kv >= (6, 6) else
            "kernel < 6.6: op probes fall back to a short list of per-probe uprobes",
            applies=kv >= (6, 6),   # a fallback, not a failure
        )
    )
    build = Path(f"/lib/modules/{platform.release()}/build")
    checks.append(
        Check("kernel headers", build.exists(), str(build), "run: bash scripts/setup.sh (links Debian's headers)")
    )
    tracefs = Path("/sys/kernel/tracing/uprobe_events")
    checks.append(Check("tracefs", tracefs.exists(), str(tracefs.parent), "mount -t tracefs nodev /sys/kernel/tracing"))
    checks.append(
        Check("BTF", Path("/sys/kernel/btf/vmlinux").exists(), "/sys/kernel/btf/vmlinux", "a kernel with CONFIG_DEBUG_INFO_BTF")
    )
    scope = ProcFS().yama_ptrace_scope() or 0
    checks.append(
        Check(
            "ptrace scope",
            scope <= 1 or os.geteuid() == 0 and scope <= 2,
            f"yama ptrace_scope={scope}",
            "agent injection needs CAP_SYS_PTRACE (scope 2) or scope <= 1; scope 3 forbids it",
        )
    )
    checks.append(
        Check("privilege", os.geteuid() == 0, f"euid={os.geteuid()}", "run as root, or grant CAP_BPF, CAP_PERFMON, CAP_SYS_PTRACE")
    )
    try:
        from bcc import BPF  # noqa: F401 — only probing importability

        checks.append(Check("bcc", True, "python bcc importable"))
        try:
            BPF(text="int sl_probe(void *ctx) { return 0; }").cleanup()
            checks.append(Check("bpf load", True, "compiled and loaded a trivial program"))
        except Exception as e:  # BCC raises plain Exceptions
            checks.append(Check("bpf load", False, str(e).splitlines()[0][:200], "check headers, privilege and dmesg"))
    except ImportError as e:
        checks.append(Check("bcc", False, str(e), "apt-get install python3-bpfcc; use the .venv from scripts/setup.sh"))
    return checks


def process_checks(pid: int) -> list[Check]:
    from stacklens.daemon.discovery import describe_process

    try:
        info = describe_process(pid)
    except Exception as e:
        return [Check(f"pid {pid}", False, str(e), "give the PID of a running process (`stacklens ps`, `ps -e`)")]
    out = [Check(f"pid {pid}", True, f"comm={info.comm}")]
    out.append(Check("python", info.python is not None,
                     info.python or "no libpython / python executable mapped: Python stacks do not apply",
                     applies=info.python is not None))
    what = {"libcuda": "CUDA API probes", "libamdhip64": "HIP API probes", "libtorch_cpu": "operator probes"}
    for lib, probes in what.items():
        paths = info.libraries.get(lib, [])
        out.append(Check(lib, bool(paths), ", ".join(paths) or f"not mapped: {probes} do not apply",
                         applies=bool(paths)))
    return out


def run_doctor(pid: int | None = None) -> int:
    checks = system_checks()
    if pid is not None:
        checks += process_checks(pid)
    return report(checks)


def report(checks: list[Check], out=None) -> int:
    """Print the checks; 1 if any failed, else 0."""
    bad = 0
    for c in checks:
        print(f"[{c.mark}] {c.name:16} {c.detail}", file=out)
        if c.failed:
            bad += 1
            if c.fix:
                print(f"       fix: {c.fix}", file=out)
    return 1 if bad else 0
