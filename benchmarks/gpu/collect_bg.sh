#!/usr/bin/env bash
# Collect the background memory run that `MEM_BG=1 bash benchmarks/gpu/run_all.sh` started (same
# machine, next call): wait for it (at most WAIT_S, default 420 s), then copy its results to $OUT.
#   device:  bash benchmarks/gpu/collect_bg.sh
set -uo pipefail
BG=/tmp/stacklens-membg
OUT=${OUT:-/tmp/stacklens-gpu-out}
mkdir -p "$OUT"
if [ ! -f "$BG/pid" ]; then
  echo "collect_bg: no background run in $BG (a fresh machine? run_all.sh with MEM_BG=1 starts one)"; exit 1
fi
pid=$(cat "$BG/pid")
end=$(( $(date +%s) + ${WAIT_S:-420} ))
while kill -0 "$pid" 2>/dev/null && [ "$(date +%s)" -lt "$end" ]; do
  tail -n 1 "$BG/bench.log"; sleep 15
done
kill -0 "$pid" 2>/dev/null && echo "collect_bg: still running after ${WAIT_S:-420}s; copying what it has"
for f in overhead.md results.json memory_partial.json bench.log; do
  [ -f "$BG/$f" ] && cp "$BG/$f" "$OUT/membg_$f"
done
tail -n 40 "$BG/bench.log"
ls -la "$OUT"
