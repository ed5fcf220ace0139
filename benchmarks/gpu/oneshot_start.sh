#!/usr/bin/env bash
# Issue 28 acceptance 4 on the lent GPU machine (~3 minutes):
#
#   device:  bash benchmarks/gpu/oneshot_start.sh [ARGS]     (carry [".device"]; results under $OUT)
set -uo pipefail
# shellcheck disable=SC1091
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
timeout -k 10 "${LIMIT_S:-400}" "$PY" benchmarks/gpu/oneshot_start.py --out "$OUT/oneshot" "$@" 2>&1 | tee "$OUT/oneshot_start.log"
rc=${PIPESTATUS[0]}
cp "$OUT"/oneshot/oneshot_start.json "$OUT"/oneshot/oneshot_start.md "$OUT/" 2>/dev/null
tar -C "$OUT/oneshot" -czf "$OUT/oneshot-logs.tar.gz" --exclude='*.sock' . 2>/dev/null
rm -rf "$OUT/oneshot"; rm -f "$SLPATH/stacklens"; rmdir "$SLPATH"
exit "$rc"
