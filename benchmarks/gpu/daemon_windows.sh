#!/usr/bin/env bash
# Issue 41 acceptance 1 and 2 on the lent GPU machine, in one call (~7 minutes):
#
#   device:  bash benchmarks/gpu/daemon_windows.sh [ARGS]     (carry [".device"]; results under $OUT)
set -uo pipefail
# shellcheck disable=SC1091
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
timeout -k 10 "${LIMIT_S:-540}" "$PY" benchmarks/gpu/daemon_windows.py --out "$OUT/run" "$@" 2>&1 | tee "$OUT/daemon_windows.log"
rc=${PIPESTATUS[0]}
cp "$OUT/run/daemon_windows.json" "$OUT/run/daemon_windows.md" "$OUT/" 2>/dev/null
tar -C "$OUT/run" -czf "$OUT/logs.tar.gz" --exclude='*.sock' . 2>/dev/null && rm -rf "$OUT/run"
rm -f "$SLPATH/stacklens"; rmdir "$SLPATH"
exit "$rc"
