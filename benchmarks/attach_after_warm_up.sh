#!/bin/bash
# Issue 20.3: `stacklens attach` through a daemon that was running when the job started (its
# housekeeping compiled the job's BPF program ahead: Daemon.warm_up). Run as root from anywhere:
#   RUNS=3 TARGET=tests/targets/inject_torch.py bash benchmarks/attach_after_warm_up.sh
# Per run: fresh stacklensd, then one target; wait for the daemon's "BPF programs prepared" log
# line; time `stacklens attach`, then detach.
cd "$(dirname "$0")/.."
B=.venv/bin
for run in $(seq 1 "${RUNS:-3}"); do
  D=$(mktemp -d); S=$D/run/s.sock
  $B/stacklensd --socket $S --metrics-address off --log-level info >$D/out 2>$D/log & DP=$!
  for i in $(seq 50); do grep -q ready $D/out && break; sleep 0.2; done
  $B/python ${TARGET:-tests/targets/inject_torch.py} $D/nostop > $D/t 2>/dev/null & T=$!
  for j in $(seq 100); do [ -s $D/t ] && break; sleep 0.1; done
  w0=$(date +%s.%N)
  for j in $(seq 600); do grep -q "BPF programs prepared" $D/log && break; sleep 0.1; done
  w1=$(date +%s.%N)
  $B/stacklens --socket $S attach $T >$D/a 2>&1; rc=$?
  t1=$(date +%s.%N)
  $B/stacklens --socket $S detach $T >/dev/null 2>&1
  printf "run %d: warm-up %.1f s after the target was ready; attach rc %d in %.1f s\n" $run \
    $(echo "$w1 - $w0" | bc) $rc $(echo "$t1 - $w1" | bc)
  kill -TERM $DP; wait $DP; kill $T 2>/dev/null; wait $T 2>/dev/null
  rm -rf $D
done
