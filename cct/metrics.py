"""The metric vocabulary: every metric a calling context tree can hold, declared once.

Pure data, no privilege, no I/O. The tree (`cct.METRICS`, the daemon's `DAEMON_METRICS`), the
TUI, the text report, the exports and the Prometheus collector all read this table; a new metric is
one `Metric` line here (tests/unit/test_metrics_registry.py checks that nothing else declares one).

Values in a tree are integers in the metric's base unit: nanoseconds for `time`, bytes for
`bytes`, events for `count`. Names end in `_ns`, `_bytes` or neither to match (checked by the same
test), so a metric from a profile written by another version still gets a unit (`kind_of`).
"""

from __future__ import annotations

from dataclasses import dataclass

TIME, COUNT, BYTES = "time", "count", "bytes"


@dataclass(frozen=True, slots=True)
class Metric:
    name: str
    kind: str           # TIME (ns), COUNT or BYTES
    label: str          # short display name (TUI headers, "metric …" in the status line)
    prom: str           # Prometheus family: stacklens_<prom>_total, in seconds for TIME
    help: str           # Prometheus HELP: what is measured and by what
    needs: str          # what measures it: "bpf" (probes), "agent" (in-process agent), "gpu" (the
                        # agent's GPU collector, CUPTI/RocTracer), "jax" (jax.monitoring)
    default: bool = False   # a column of every CCT unless told otherwise (cct.METRICS)
    # A sample count with a known rate is also exported as time: stacklens_<seconds_prom>_total =
    # samples / sampling rate (Prometheus wants seconds, not samples); its hotspots are in seconds.
    seconds_prom: str = ""
    seconds_help: str = ""


# Order: the TUI cycles through a snapshot's metrics in its tree's order, which is this one.
REGISTRY: tuple[Metric, ...] = (
    Metric("gpu_time_ns", TIME, "gpu time", "gpu_kernel_seconds",
           "GPU kernel execution time (CUPTI/RocTracer), seconds", "gpu", default=True),
    Metric("kernel_count", COUNT, "kernel count", "gpu_kernels",
           "GPU kernels that completed (CUPTI/RocTracer)", "gpu", default=True),
    Metric("launch_count", COUNT, "launch count", "kernel_launches",
           "GPU kernel launches seen at the driver API", "bpf", default=True),
    Metric("api_cpu_ns", TIME, "api cpu", "api_cpu_seconds",
           "CPU time inside GPU driver API calls, seconds", "bpf", default=True),
    Metric("sync_wait_ns", TIME, "sync wait", "sync_wait_seconds",
           "time the host waited in GPU synchronization calls", "bpf", default=True),
    Metric("cpu_samples", COUNT, "cpu samples", "cpu_samples",
           "CPU samples (perf cpu-clock) of the process", "bpf", default=True,
           seconds_prom="cpu_seconds",
           seconds_help="on-CPU time of the process from perf cpu-clock samples (samples / sampling rate), seconds"),
    Metric("alloc_bytes", BYTES, "alloc", "allocated_bytes",
           "bytes allocated on the device", "bpf", default=True),
    Metric("copy_bytes", BYTES, "copy", "copied_bytes",
           "bytes copied between host and device", "bpf", default=True),
    Metric("py_samples", COUNT, "py samples", "python_samples",
           "Python stack samples of all threads (the in-process agent's sampler, wall clock)", "agent"),
    Metric("compile_time_ns", TIME, "compile time", "compile_seconds",
           "JAX compilation time by call site (jax.monitoring), seconds", "jax"),
    Metric("memcpy_count", COUNT, "memcpy count", "gpu_memcpys",
           "GPU memory copies that completed (CUPTI)", "gpu"),
    Metric("memset_count", COUNT, "memset count", "gpu_memsets",
           "GPU memsets that completed (CUPTI)", "gpu"),
    Metric("memset_bytes", BYTES, "memset", "memset_bytes",
           "bytes set on the device by GPU memsets (driver API calls, CUPTI records)", "bpf"),
    Metric("collective_wait_ns", TIME, "comm wait", "collective_wait_seconds",
           "time the host waited for torch.distributed collectives to complete (c10d Work::wait, "
           "DDP's Reducer::finalize_backward), seconds", "bpf"),
)

BY_NAME: dict[str, Metric] = {m.name: m for m in REGISTRY}
ALL: tuple[str, ...] = tuple(m.name for m in REGISTRY)
DEFAULT: tuple[str, ...] = tuple(m.name for m in REGISTRY if m.default)
# Exported per context too (Prometheus hotspots), and the TUI hotspot table's columns, in order.
HOTSPOT: tuple[str, ...] = ("gpu_time_ns", "cpu_samples", "sync_wait_ns")
# The metric a view opens on: the first of these a snapshot measures with a non-zero total.
PREFERRED: tuple[str, ...] = (
    "gpu_time_ns", "cpu_samples", "py_samples", "api_cpu_ns", "launch_count", "kernel_count",
    "sync_wait_ns", "collective_wait_ns", "copy_bytes", "alloc_bytes", "compile_time_ns", "memcpy_count", "memset_count",
    "memset_bytes",
)


# the metric of the on-CPU sampler: pprof's `samples` (and `cpu` nanoseconds at its period)
CPU_SAMPLES = "cpu_samples"


def opening_metric(snap) -> str:
    """The metric a view opens on: GPU time wherever it was measured (and is non-zero), else the
    first of PREFERRED the snapshot measured with data, else the first it measured."""
    measured = [m for m in PREFERRED if m in snap.metrics and m not in snap.unavailable]
    for m in measured:
        if snap.total(m):
            return m
    return measured[0] if measured else snap.metrics[0]


def kind_of(metric: str) -> str:
    """TIME, BYTES or COUNT: the registry's, else from the name's suffix (a metric unknown here)."""
    m = BY_NAME.get(metric)
    if m is not None:
        return m.kind
    if metric.endswith("_ns"):
        return TIME
    return BYTES if metric.endswith("_bytes") else COUNT


def label_of(metric: str) -> str:
    m = BY_NAME.get(metric)
    if m is not None:
        return m.label
    return metric.removesuffix("_ns").removesuffix("_bytes").replace("_", " ")


def base_unit_scale(metric: str) -> float:
    """Factor from the stored value to the SI base unit Prometheus wants (ns → s)."""
    return 1e-9 if kind_of(metric) == TIME else 1


def fmt_value(metric: str, value: int | float, *, signed: bool = False, exact: bool = False) -> str:
    """`value` of `metric` in human units (see `fmt_quantity`)."""
    return fmt_quantity(kind_of(metric), value, signed=signed, exact=exact)


def fmt_evidence(name: str, value: int | float) -> str:
    """A finding's evidence as people read it: a share (`*_share`) in percent, a time (`*_ns`) or
    a size (`*_bytes`) in units, a whole number as itself (never 7.60606e+09), other numbers to
    four significant digits."""
    if name.endswith("_share"):
        return f"{100 * value:.1f}%"
    kind = kind_of(name)
    if kind in (TIME, BYTES):
        return fmt_quantity(kind, value)
    if float(value).is_integer():
        return str(int(value))
    return f"{value:.4g}"


def fmt_quantity(kind: str, value: int | float, *, signed: bool = False, exact: bool = False) -> str:
    """Human units: times (ns) as ns/us/ms/s, bytes as B/KiB/MiB/GiB, counts as 1.2k/3.4M (as the
    integer with `exact`). `signed` puts a + on positive values (diffs)."""
    sign = ""
    if signed and value > 0:
        sign = "+"
    elif value < 0:
        sign = "-"
    v = abs(value)
    if kind == TIME:
        if v >= 1e9:
            body = f"{v / 1e9:.2f}s"
        elif v >= 1e6:
            body = f"{v / 1e6:.1f}ms"
        elif v >= 1e3:
            body = f"{v / 1e3:.1f}us"
        else:
            body = f"{v:.0f}ns"
    elif kind == BYTES:
        body = f"{v:.0f}B"
        for step, suffix in ((1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB")):
            if v >= step:
                body = f"{v / step:.1f}{suffix}"
                break
    elif exact:
        body = str(v) if isinstance(v, int) else f"{v:.0f}"
    else:
        body = f"{v:.0f}"
        for step, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
            if v >= step * 10:
                body = f"{v / step:.1f}{suffix}"
                break
    return sign + body
