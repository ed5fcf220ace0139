"""How the TUI shows values and frames: units, shares, bars, kind tags and colours.

No privilege, no I/O, no Textual. Names, units and labels of metrics come from the registry
(cct/metrics.py); CPU samples are shown as time where the snapshot carries the sampling rate.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from stacklens.cct import Frame, metrics

# The snapshot type is duck-typed (cct.Snapshot or anything with the same reading API).
Snap = Any

_KIND_TAG = {
    "python": "py",
    "op": "op",
    "native": "nat",
    "gpu_api": "api",
    "kernel": "krn",
    "instruction": "ins",
    "backward": "bwd",
    "module": "mod",
    "other": "",
}
KIND_STYLE = {
    "python": "green",
    "op": "cyan",
    "native": "white",
    "gpu_api": "yellow",
    "kernel": "magenta",
    "instruction": "blue",
    "backward": "red",
    "module": "bright_green",
    "other": "bright_black",
}


def window_label(window_s: float | None) -> str:
    return "cumulative" if window_s is None else f"last {window_s:g} s"


def metric_label(metric: str) -> str:
    return metrics.label_of(metric)


def fmt_value(metric: str, value: int | float, *, signed: bool = False) -> str:
    """Human units from the registry: times as us/ms/s, bytes as KiB/MiB/GiB, counts as 1.2k/3.4M."""
    return metrics.fmt_value(metric, value, signed=signed)


def fmt_share(value: int | float, total: int | float, *, signed: bool = False) -> str:
    """`value` as a % of `total`; `signed` (a diff) keeps the sign: +12.0% grew, -3.5% shrank."""
    if not total:
        return "  -  "
    if signed:
        return f"{100.0 * value / total:+6.1f}%" if value else "   0.0%"
    return f"{100.0 * value / total:5.1f}%"


# A sampled metric and the meta key of its sampling rate (Hz): with the rate known, samples are
# shown as time (samples / rate); without it, as sample counts, labelled "samples".
SAMPLE_RATES = {metrics.CPU_SAMPLES: "cpu_hz"}


@dataclass(frozen=True, slots=True)
class Unit:
    """How a metric's values are shown: in the metric's own unit, or a sample count as time."""

    metric: str
    hz: float = 0.0  # samples per second of a sampled metric; 0: shown as it is stored

    @property
    def label(self) -> str:
        return "cpu time" if self.hz else metric_label(self.metric)

    def fmt(self, value: int | float, *, signed: bool = False) -> str:
        if self.hz:
            return metrics.fmt_quantity(metrics.TIME, value * 1e9 / self.hz, signed=signed)
        return fmt_value(self.metric, value, signed=signed)


def unit_of(snap: Snap | None, metric: str) -> Unit:
    """The metric's unit in this snapshot: time where it is a sample count whose rate the
    snapshot's meta carries (the daemon's `cpu_hz`; a window or a diff keeps it when both agree)."""
    key = SAMPLE_RATES.get(metric)
    meta = getattr(snap, "meta", None)
    if key is None or not isinstance(meta, dict):
        return Unit(metric)
    try:
        hz = float(meta.get(key) or 0)
    except (TypeError, ValueError):
        hz = 0.0
    return Unit(metric, hz if math.isfinite(hz) and hz > 0 else 0.0)


_EIGHTHS = " ▏▎▍▌▋▊▉"


def bar(fraction: float, width: int) -> str:
    """A left-aligned bar of `width` cells filled to `fraction` (clamped to [0, 1]), in 1/8 cells."""
    if width <= 0:
        return ""
    fraction = 0.0 if math.isnan(fraction) else min(1.0, max(0.0, fraction))
    eighths = round(fraction * width * 8)
    full, part = divmod(eighths, 8)
    text = "█" * full + (_EIGHTHS[part] if part and full < width else "")
    return text.ljust(width)


def kind_tag(frame: Frame) -> str:
    return _KIND_TAG.get(frame.kind, "")
