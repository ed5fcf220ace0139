"""`stacklens doctor`: preflight of what attaching needs, with the fix for each failed check.

Reads procfs/sysfs and, with a PID, the ELF symbols of its GPU libraries (which exports each
probe would attach to: the full list the attach notes shorten); loading a trivial BPF program
needs root (or CAP_BPF + CAP_PERFMON). `--json` prints the same checks as one JSON document.
Exit status 1 when any check fails. A check that does not apply (libcuda on a CPU job, Python
stacks in a process that is not Python) reads "n/a" and fails nothing.
"""

from __future__ import annotations

import json
import os
import platform
import re
import sys
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
    return out + probe_checks(pid)


def probe_checks(pid: int) -> list[Check]:
    """For each GPU library the process maps, the probed symbols it exports, those it does not,
    and the exported versions probes attach to, in full (an attach note shows their first part)."""
    from stacklens.bpf.procmaps import find_libraries
    from stacklens.bpf.spec import DEFAULT_SPEC, load_specs, resolve_library

    by_re: dict[str, list] = {}
    for s in load_specs(DEFAULT_SPEC):
        by_re.setdefault(s.library, []).append(s)
    out = []
    for pattern, specs in by_re.items():
        try:
            libs = find_libraries(pid, re.compile(pattern))
        except Exception:   # the process went away or its maps are unreadable: process_checks said so
            return out
        for lib in libs:
            name = f"probes {os.path.basename(lib.path)}"
            try:
                res = resolve_library(lib.host_path, specs)
            except Exception as e:   # unreadable or not an ELF file: say so, fail nothing else
                out.append(Check(name, False, f"{lib.path}: cannot read its symbols ({e})",
                                 "run as root (the file is read through /proc/PID/root)"))
                continue
            parts = [f"{len(res.sites)} probe sites for {len(specs) - len(res.missing)}/{len(specs)} probed symbols"]
            if res.missing:
                parts.append(f"not exported: {', '.join(res.missing)}")
            if res.summary():
                parts.append(f"probes on exported versions: {res.summary()}")
            out.append(Check(name, bool(res.sites), "; ".join(parts),
                             "the library exports none of the probed symbols: GPU API probes do not apply",
                             applies=bool(res.sites)))
    return out


def run_doctor(pid: int | None = None, *, as_json: bool = False) -> int:
    checks = system_checks()
    if pid is not None:
        checks += process_checks(pid)
    return report_json(checks) if as_json else report(checks)


def check_status(c: Check) -> str:
    return "n/a" if not c.applies else "ok" if c.ok else "fail"


def report_json(checks: list[Check], out=None) -> int:
    """The checks as one JSON document (`ok`: no check failed; each check's status is "ok",
    "fail" or "n/a"); the exit status as `report` gives it."""
    failed = any(c.failed for c in checks)
    doc = {"ok": not failed,
           "checks": [{"name": c.name, "status": check_status(c), "detail": c.detail, "fix": c.fix if c.failed else ""}
                      for c in checks]}
    out = out or sys.stdout
    json.dump(doc, out, indent=2)
    out.write("\n")
    return 1 if failed else 0


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
