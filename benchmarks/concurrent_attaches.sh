#!/bin/bash
# Issue 17 acceptance 1, by hand (docs/benchmarks/soak.md "Concurrent attaches"). Run as root from the
# repository root: bash benchmarks/concurrent_attaches.sh
# RUNS (20) runs of: fresh stacklensd, TARGETS (8) idle Python targets, as many concurrent `stacklens attach`,
# then concurrent detaches
cd "$(dirname "$0")/.."
B=.venv/bin
for run in $(seq 1 "${RUNS:-20}"); do
  D=$(mktemp -d); S=$D/run/s.sock
  $B/stacklensd --socket $S --metrics-address off >$D/out 2>$D/log & DP=$!
  for i in $(seq 50); do grep -q ready $D/out && break; sleep 0.2; done
  T=(); for i in $(seq "${TARGETS:-8}"); do $B/python ${TARGET:-tests/targets/inject_sleep.py} $D/nostop > $D/t$i & T+=($!); done
  for i in $(seq "${TARGETS:-8}"); do for j in $(seq 50); do [ -s $D/t$i ] && break; sleep 0.1; done; done
  t0=$(date +%s.%N)
  P=(); for pid in "${T[@]}"; do $B/stacklens --socket $S attach $pid >$D/a$pid 2>&1 & P+=($!); done
  ok=0; bad=0; for p in "${P[@]}"; do if wait $p; then ok=$((ok+1)); else bad=$((bad+1)); fi; done
  t1=$(date +%s.%N)
  P=(); for pid in "${T[@]}"; do $B/stacklens --socket $S detach $pid >$D/d$pid 2>&1 & P+=($!); done
  dok=0; for p in "${P[@]}"; do wait $p && dok=$((dok+1)); done
  alive=no; kill -0 $DP 2>/dev/null && alive=yes
  kill -TERM $DP; wait $DP; rc=$?
  kill "${T[@]}" 2>/dev/null; wait "${T[@]}" 2>/dev/null
  errs=$(cat $D/a* | grep -c "Traceback\|error" )
  printf "run %2d: attaches ok %d failed %d (%.1f s), detaches ok %d, daemon alive %s, exit rc %d, error lines %d\n" $run $ok $bad $(echo "$t1 - $t0" | bc) $dok $alive $rc $errs
  rm -rf $D
done
