#!/usr/bin/env bash
# Issue 35 on the lent GPU machine, in one call (~8 minutes):
#
#   device:  bash benchmarks/gpu/safety_matrix.sh [ARGS]     (carry [".device"]; results under $OUT)
#
# The BCC bundle and cupti-python from .device (../shared/device/README.md), stacklens importable
# from the repository, then benchmarks/gpu/safety_matrix.py (its docstring says what it counts).
set -uo pipefail
OUT=${OUT:-/tmp/stacklens-safety-out}
# shellcheck disable=SC1091
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
timeout -k 10 "${LIMIT_S:-570}" "$PY" benchmarks/gpu/safety_matrix.py --out "$OUT/run" "$@" 2>&1 | tee "$OUT/safety_matrix.log"
rc=${PIPESTATUS[0]}
cp "$OUT/run/safety_matrix.json" "$OUT/run/safety_matrix.md" "$OUT/" 2>/dev/null
tar -C "$OUT/run" -czf "$OUT/logs.tar.gz" . 2>/dev/null && rm -rf "$OUT/run"
rm -f "$SLPATH/stacklens"; rmdir "$SLPATH"
exit "$rc"
