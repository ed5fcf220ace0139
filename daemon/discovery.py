"""Discovery of processes worth profiling: which map a GPU driver library, libtorch, libpython.

Reads /proc/PID/{comm,maps,cgroup}; reading another user's maps needs root or CAP_SYS_PTRACE.
Cost: one read of each process's maps per scan (the daemon scans every few seconds).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field

from stacklens.errors import NoSuchProcess, PermissionDenied
from stacklens.introspect.procfs import ProcFS, parse_maps
from stacklens.textsafe import safe_text

LIBRARY_PATTERNS = {
    "libcuda": re.compile(r"/libcuda\.so(\.\d+)*$"),
    "libamdhip64": re.compile(r"/libamdhip64\.so(\.\d+)*$"),
    "libtorch_cpu": re.compile(r"/libtorch_cpu\.so$"),
    "libpython": re.compile(r"/libpython3\.\d+t?\.so(\.[\d.]+)?$"),
    # jaxlib's extension module: _jax.so since jaxlib 0.5, xla_extension.so before
    "jaxlib": re.compile(r"/jaxlib/(_jax|xla_extension)(\.[\w-]+)?\.so$"),
}
GPU_LIBS = ("libcuda", "libamdhip64")
FRAMEWORK_LIBS = {"libtorch_cpu": "torch", "jaxlib": "jax"}


@dataclass(frozen=True)
class ProcessInfo:
    pid: int
    comm: str
    exe: str
    libraries: dict[str, list[str]] = field(default_factory=dict)
    python: str | None = None  # e.g. "python3.11 (/usr/bin/python3.11)" when an interpreter is mapped
    container: str = ""

    @property
    def gpu(self) -> bool:
        return any(self.libraries.get(k) for k in GPU_LIBS)

    @property
    def frameworks(self) -> tuple[str, ...]:
        """The ML frameworks it has loaded ("torch", "jax"), GPU or not."""
        return tuple(name for lib, name in FRAMEWORK_LIBS.items() if self.libraries.get(lib))


def mapped_files(maps_text: str) -> list[str]:
    seen: dict[str, None] = {}
    for m in parse_maps(maps_text):
        if m.path.startswith("/"):
            seen.setdefault(m.path.removesuffix(" (deleted)"), None)
    return list(seen)


def _container_of(cgroup_text: str) -> str:
    # docker/containerd/podman put a 64-hex id in the cgroup path; keep a short, bounded label.
    m = re.search(r"([0-9a-f]{64})", cgroup_text)
    return m.group(1)[:12] if m else ""


def describe_process(pid: int, procfs: ProcFS | None = None) -> ProcessInfo:
    procfs = procfs or ProcFS()
    if pid <= 0:
        raise NoSuchProcess(f"invalid PID {pid}: give the PID of a running process (see `stacklens ps`)")
    comm = procfs.read(pid, "comm").strip()
    files = mapped_files(procfs.read(pid, "maps"))
    libs: dict[str, list[str]] = {}
    for f in files:
        for name, pat in LIBRARY_PATTERNS.items():
            if pat.search(f):
                libs.setdefault(name, []).append(f)
    exe = procfs.exe(pid)
    python = None
    m = re.search(r"python(3\.\d+)", os.path.basename(exe))
    if libs.get("libpython"):
        lp = libs["libpython"][0]
        ver = re.search(r"libpython(3\.\d+t?)", lp)
        python = f"{ver.group(1) if ver else '3'} ({lp})"
    elif m:
        python = f"{m.group(1)} ({exe})"
    try:
        container = _container_of(procfs.read(pid, "cgroup"))
    except NoSuchProcess:
        container = ""
    # names the process chose (comm, file names): control characters escaped for `ps` (textsafe.py)
    return ProcessInfo(pid=pid, comm=safe_text(comm), exe=safe_text(exe),
                       libraries={k: [safe_text(f) for f in v] for k, v in libs.items()},
                       python=safe_text(python) if python else python, container=container)


def scan(procfs: ProcFS | None = None, *, gpu_only: bool = True) -> list[ProcessInfo]:
    """Every process that maps a GPU driver library (with gpu_only=False also every one with
    torch or JAX loaded, GPU or not: a CPU job is worth a profile too)."""
    procfs = procfs or ProcFS()
    out = []
    for pid in procfs.pids():
        if pid == os.getpid():
            continue
        try:
            info = describe_process(pid, procfs)
        except (NoSuchProcess, PermissionDenied):
            continue
        if info.gpu or (not gpu_only and info.frameworks):
            out.append(info)
    return out
