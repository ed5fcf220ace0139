#!/bin/bash
# Concurrent attaches through stacklensd, by hand (issue 17 acceptance 1, issue 26 acceptance 2;
# results in docs/benchmarks/attach.md and soak.md). Run as root from the repository root:
#   bash benchmarks/concurrent_attaches.sh                         RUNS (20) runs of: fresh stacklensd,
#       TARGETS (8) idle Python targets, as many concurrent `stacklens attach`, then concurrent detaches
#   AGENT=1 bash benchmarks/concurrent_attaches.sh                 the same with `attach --agent`
#   AGENT=1 KILL9=5 bash benchmarks/concurrent_attaches.sh         then KILL9 rounds on one daemon and one
#       set of targets, all attached: kill -9 the daemon, restart it, count what it left behind (agent
#       files of the targets, before the restart and once the new daemon says ready; the token is a
#       new one?), and attach them all again at once
# BIN: where stacklens and stacklensd are (.venv/bin); TARGET: the target script (tests/targets/
# inject_sleep.py; with AGENT=1 tests/targets/idle_loop.py, whose main thread runs Python every 10 ms
# so the agent's bootstrap can run). Exit status 0 when every attach and detach succeeded and no
# agent file was left after a restart.
cd "$(dirname "$0")/.."
B=${BIN:-.venv/bin}
N=${TARGETS:-8}
if [ -n "$AGENT" ]; then ATTACH=(attach --agent); TGT=${TARGET:-tests/targets/idle_loop.py}
else ATTACH=(attach); TGT=${TARGET:-tests/targets/inject_sleep.py}; fi
AGENTS=/run/stacklens/agents
failed=0

start_daemon() {   # $1: output file; sets DP
  $B/stacklensd --socket $S --metrics-address off >"$1" 2>>$D/log & DP=$!
  for _ in $(seq 600); do grep -qs ready "$1" && return 0; kill -0 $DP 2>/dev/null || break; sleep 0.1; done
  echo "stacklensd did not start: $(tail -3 $D/log)"; exit 2
}
start_targets() {  # sets T
  T=(); for i in $(seq "$N"); do $B/python $TGT $D/nostop > $D/t$i & T+=($!); done
  for i in $(seq "$N"); do for _ in $(seq 600); do [ -s $D/t$i ] && break; sleep 0.1; done; done
}
attach_all() {     # $1: tag; sets ok, bad, serves (false "already serves"), internal, secs
  local t0 P=(); t0=$(date +%s.%N)
  for pid in "${T[@]}"; do $B/stacklens --socket $S "${ATTACH[@]}" $pid >$D/$1-$pid 2>&1 & P+=($!); done
  ok=0; bad=0; for p in "${P[@]}"; do if wait $p; then ok=$((ok+1)); else bad=$((bad+1)); fi; done
  secs=$(echo "$(date +%s.%N) - $t0" | bc)
  serves=$(cat $D/$1-* | grep -c "already serves"); internal=$(cat $D/$1-* | grep -c "internal error")
  [ $bad -eq 0 ] || { failed=1; for pid in "${T[@]}"; do grep -H "error" $D/$1-$pid; done | head -3; }
}
detach_all() {     # sets dok
  local P=(); for pid in "${T[@]}"; do $B/stacklens --socket $S detach $pid >$D/d$pid 2>&1 & P+=($!); done
  dok=0; for p in "${P[@]}"; do wait $p && dok=$((dok+1)); done
  [ $dok -eq ${#T[@]} ] || failed=1
}
left() {           # agent files of the targets in the host's agent directory
  local n=0; for pid in "${T[@]}"; do n=$((n + $(ls $AGENTS 2>/dev/null | grep -c "^agent-$pid[.-]"))); done; echo $n
}

for run in $(seq 1 "${RUNS:-20}"); do
  D=$(mktemp -d); S=$D/run/s.sock
  start_daemon $D/out
  start_targets
  attach_all a
  detach_all
  alive=no; kill -0 $DP 2>/dev/null && alive=yes
  kill -TERM $DP; wait $DP; rc=$?
  kill "${T[@]}" 2>/dev/null; wait "${T[@]}" 2>/dev/null
  errs=$(cat $D/a-* | grep -c "Traceback\|error" )
  printf "run %2d: attaches ok %d failed %d (%.1f s; already-serves %d, internal %d), detaches ok %d, %s\n" \
    $run $ok $bad $secs $serves $internal $dok "daemon alive $alive, exit rc $rc, error lines $errs"
  rm -rf $D
done

if [ "${KILL9:-0}" -gt 0 ]; then
  D=$(mktemp -d); S=$D/run/s.sock
  start_daemon $D/out
  start_targets
  attach_all k0
  printf "kill9 setup: attaches ok %d failed %d (%.1f s)\n" $ok $bad $secs
  for k in $(seq 1 "$KILL9"); do
    tok=$(md5sum < $D/run/token)
    kill -9 $DP; wait $DP 2>/dev/null
    before=$(left)
    start_daemon $D/out$k
    after=$(left)
    fresh=no; [ "$(md5sum < $D/run/token)" != "$tok" ] && fresh=yes
    [ "$after" -eq 0 ] && [ $fresh = yes ] || failed=1
    attach_all k$k
    printf "kill9 %d: agent files after kill -9 %d, after restart %d, new token %s; %s\n" $k $before $after $fresh \
      "$(printf "re-attaches ok %d failed %d (%.1f s; already-serves %d, internal %d)" $ok $bad $secs $serves $internal)"
  done
  detach_all
  kill -TERM $DP; wait $DP
  kill "${T[@]}" 2>/dev/null; wait "${T[@]}" 2>/dev/null
  printf "kill9 end: detaches ok %d, agent files left %d\n" $dok $(left)
  rm -rf $D
fi
exit $failed
