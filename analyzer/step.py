"""The step model the rules' savings come from: the GPU's busy and idle time over the window,
and the idle time charged to what the CPU was doing meanwhile.

Pure, no privilege, no I/O; O(nodes) once per view (memoized).

    busy  = GPU time of kernels, copies and memsets (`gpu_time_ns`, CUPTI records). Streams that
            overlap are not subtracted, so busy is an upper bound and idle a lower bound.
    idle  = window - busy: the time the GPU waited for the CPU.
    cpu   = the CPU's part of the critical path: at least the time the GPU waited for it (idle),
            and at least the busiest thread's CPU time outside sync waits (cpu_samples/cpu_hz).

A fix that removes `s` ns of GPU time shortens the window by max(cpu, busy) - max(cpu, busy - s):
all of it on a GPU-bound job, nothing on a launch-bound one (the GPU would only idle longer). A
fix that closes idle gaps (CUDA graphs) shortens it by the idle time closed. A sync stalls the
step only where the GPU went idle behind it: its wait x the GPU's idle share, at most the idle
time (a launch-bound job loses the whole wait, a GPU-bound one little of it).
"""

from __future__ import annotations

from dataclasses import dataclass

from stacklens.analyzer.view import View


@dataclass(frozen=True)
class Step:
    wall_ns: float
    busy_ns: float
    kernel_ns: int          # GPU time of kernels alone
    kernels: int            # kernels executed (CUPTI records)
    launches: int           # launch calls (BPF); kernel records where launches were not counted
    cpu_ns: float           # the CPU's part of the critical path (module docstring)
    thread_cpu_ns: float | None  # the busiest thread's CPU time, where samples carry threads

    @property
    def idle_ns(self) -> float:
        return max(0.0, self.wall_ns - self.busy_ns)

    @property
    def busy_share(self) -> float:
        return min(1.0, self.busy_ns / self.wall_ns)

    @property
    def mean_kernel_ns(self) -> float:
        return self.kernel_ns / self.kernels if self.kernels else 0.0

    def gpu_saving(self, saved_gpu_ns: float) -> float:
        """Share of the window a fix that removes `saved_gpu_ns` of GPU time gives back."""
        top = max(self.cpu_ns, self.busy_ns)
        after = max(self.cpu_ns, self.busy_ns - max(0.0, saved_gpu_ns))
        return max(0.0, min(1.0, (top - after) / self.wall_ns))

    def idle_saving(self, closed_idle_ns: float) -> float:
        """Share of the window a fix that closes `closed_idle_ns` of GPU idle time gives back."""
        return max(0.0, min(self.idle_ns, closed_idle_ns)) / self.wall_ns

    def sync_saving(self, wait_ns: float) -> float:
        """Share of the window removing a sync that waited `wait_ns` can give back: the wait is on
        the critical path as often as the CPU is, i.e. the GPU's idle share of the window (while
        the GPU is busy, a waiting CPU costs nothing), and never more than the idle time."""
        idle_share = self.idle_ns / self.wall_ns
        return max(0.0, min(wait_ns * idle_share, self.idle_ns)) / self.wall_ns

    def evidence(self) -> dict[str, float]:
        ev = {
            "wall_ns": round(self.wall_ns),
            "gpu_busy_ns": round(self.busy_ns),
            "gpu_idle_ns": round(self.idle_ns),
            "gpu_busy_share": round(self.busy_share, 4),
            "cpu_critical_ns": round(self.cpu_ns),
        }
        if self.thread_cpu_ns is not None:
            ev["busiest_thread_cpu_ns"] = round(self.thread_cpu_ns)
        return ev


def step_of(view: View) -> Step | None:
    """The step model of `view`'s snapshot; None where GPU time or the window's length was not
    measured (the rules then keep to what they can say without it)."""
    return view.memo("step", lambda: _compute(view))  # type: ignore[return-value]


def _compute(view: View) -> Step | None:
    gpu = view.col("gpu_time_ns")
    if gpu is None or not view.wall_ns:
        return None
    frames = view.frames
    kernel_ns = sum(v for i, v in enumerate(gpu) if v and frames[i].kind == "kernel")
    busy = float(view.totals.get("gpu_time_ns", 0))
    wall = max(float(view.wall_ns), busy)   # kernels that overlapped can sum past the window
    kernels = view.totals.get("kernel_count", 0)
    launches = view.totals.get("launch_count") or kernels
    thread_cpu = None
    per = view.thread_cpu_samples()
    hz = view.cpu_hz
    if per and hz:
        thread_cpu = max(per.values()) / hz * 1e9
    cpu = max(wall - busy, (thread_cpu or 0.0) - view.totals.get("sync_wait_ns", 0))
    return Step(wall, busy, kernel_ns, kernels, launches, min(cpu, wall), thread_cpu)


def user_lines(view: View) -> list[int]:
    """For every node, the innermost Python frame of the user's own code at or above it (not a
    library: torch, transformers, the agent), else its Python line; 0 without one."""
    def compute() -> list[int]:
        from stacklens.analyzer.rules._common import is_library_file

        lib = [f.kind == "python" and is_library_file(f.file) for f in view.distinct]
        fid, parents, line = view.frame_id, view.parents, view.line
        own = [0] * view.n
        for i in range(1, view.n):
            own[i] = i if (view.is_python[i] and not lib[fid[i]]) else own[parents[i]]
        return [own[i] or line[i] for i in range(view.n)]

    return view.memo("user_lines", compute)  # type: ignore[return-value]
