"""Measured speedups of fp32 GEMMs under TF32, by kernel: the table the fp32_gemm rule reads.

The table (`gemm_speedups.json` in analyzer/data/) is written on the GPU machine by
benchmarks/gpu/gemm_speedups.py: per GEMM or convolution shape, its GPU time in fp32, TF32 and
bf16, the kernels each mode ran, and the speedups over fp32. `SpeedupTable.tf32(name, mean_ns)`
looks a kernel of a profile up: the rows whose fp32 run used that kernel (its short label, tile
sizes included), else one of its family (the label without tile, stage and alignment sizes);
among those, the size class: the rows within 2x of the kernel's mean time per launch, else the
nearest one. Their median TF32 speedup is the answer; no row, no answer (the rule then guesses
and says so).

Reads one JSON file, once per process and path; no privilege. A missing file is no table; a
file that is not such a table is an InputError naming it. Rows of a `--cpu-smoke` table are
never used (TF32 does nothing on a CPU).
"""

from __future__ import annotations

import json
import math
import re
import statistics
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from stacklens.errors import InputError

from stacklens.analyzer.rules._common import kernel_label

TABLE_NAME = "gemm_speedups.json"
DEFAULT_TABLE = Path(__file__).resolve().parents[1] / "data" / TABLE_NAME
FORMAT = "stacklens.gemm_speedups"
_SIZE_CLASS = 2.0   # rows within this factor of a kernel's mean time per launch are its size class

_SIZES = re.compile(r"(?:tilesize|warpsize|stage|align[a-z]?)\d+(?:x\d+)*|(?<![a-z])\d+x\d+(?:x\d+)*")


def kernel_family(name: str) -> str:
    """A kernel's label without its tile, stage and alignment sizes:
    `cutlass_80_simt_sgemm_64x64_8x5_tn_align1` -> `cutlass_80_simt_sgemm_tn`."""
    return re.sub(r"_+", "_", _SIZES.sub("", kernel_label(name, 400))).strip("_")


@dataclass(frozen=True)
class Row:
    labels: frozenset[str]     # short labels of the kernels the fp32 run used
    families: frozenset[str]
    fp32_ns: float             # GPU time of one fp32 call
    tf32: float                # fp32 time / TF32 time


@dataclass(frozen=True)
class Match:
    speedup: float
    how: str                   # "kernel" or "family"
    rows: int


@dataclass(frozen=True)
class SpeedupTable:
    source: str                # the path as a finding names it
    device: str
    rows: tuple[Row, ...]

    def tf32(self, kernel_name: str, mean_ns: float) -> Match | None:
        """TF32's measured speedup for this fp32 kernel at this time per launch; None without a row."""
        label = kernel_label(kernel_name, 400)
        for how, hit in (("kernel", [r for r in self.rows if label in r.labels]),
                         ("family", [r for r in self.rows if kernel_family(kernel_name) in r.families])):
            if not hit:
                continue
            if mean_ns > 0:
                near = [r for r in hit if abs(math.log(r.fp32_ns / mean_ns)) <= math.log(_SIZE_CLASS)]
                hit = near or [min(hit, key=lambda r: abs(math.log(r.fp32_ns / mean_ns)))]
            return Match(statistics.median(r.tf32 for r in hit), how, len(hit))
        return None


def load_table(path: str | Path, shown_as: str | None = None) -> SpeedupTable | None:
    """The table at `path`; None where there is no file. Cached per path and modification time."""
    p = Path(path)
    try:
        mtime = p.stat().st_mtime_ns
    except OSError:
        return None
    return _load(str(p), mtime, shown_as or str(p))


@lru_cache(maxsize=8)
def _load(path: str, mtime: int, shown_as: str) -> SpeedupTable:
    try:
        data = json.loads(Path(path).read_text())
        if data.get("format") != FORMAT:
            raise ValueError(f"format is {data.get('format')!r}, not {FORMAT!r}")
        meta = data.get("meta", {})
        rows = () if meta.get("cpu_smoke") else tuple(filter(None, map(_row, data["rows"])))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise InputError(f"{shown_as}: not a GEMM speedup table ({e}); write it with "
                         "benchmarks/gpu/gemm_speedups.py, or set rules.fp32_gemm.speedup_table to ''") from None
    return SpeedupTable(shown_as, str(meta.get("device", "an unnamed GPU")), rows)


def _row(r: dict) -> Row | None:
    """A usable row: fp32 kernels named, fp32 time and TF32 speedup positive."""
    fp32 = r["modes"].get("fp32") or {}
    names = [k["name"] for k in fp32.get("kernels", ())]
    speedup = (r.get("speedup") or {}).get("tf32")
    ms = fp32.get("ms")
    if not names or not speedup or not ms or speedup <= 0 or ms <= 0:
        return None
    return Row(frozenset(kernel_label(n, 400) for n in names), frozenset(map(kernel_family, names)),
               float(ms) * 1e6, float(speedup))
