#!/bin/bash
# Issue 26 acceptance 1 (docs/benchmarks/sessions.md): do sessions hold next to a torch DataLoader loop
# whose iterator (and its workers, and the code objects it makes) is re-created every epoch?
# Run as root from the repository root:  bash benchmarks/soak_dataloader.sh
#   DURATION (600) seconds; POLL (5) seconds between `stacklens ps`; WORKERS (2) DataLoader workers;
#   KEEP_GOING=1 polls on after a session ended (default: stop at the first one that is not attached);
#   HOSTILE=1: the loop's per-epoch code objects get a cut location table (dataloader_epochs.py `cut`),
#   the bad read this soak is about, every epoch, for when the race does not come on its own.
# One fresh stacklensd; a quiet target (tests/targets/inject_sleep.py) attached first, then the DataLoader
# loop (tests/targets/dataloader_epochs.py); `stacklens ps` every POLL s; every 60 s the loop's profile is
# read (its CPU samples must grow: a live profile that froze is a failure too). Prints one line per
# minute and a verdict; exit 0 when every session stayed attached and the profile grew, 1 otherwise.
cd "$(dirname "$0")/.."
B=.venv/bin
DURATION=${DURATION:-600}; POLL=${POLL:-5}
D=$(mktemp -d /tmp/soak_dataloader.XXXXXX); S=$D/run/s.sock
echo "soak_dataloader: $(date -u +%FT%TZ), $(nproc) CPUs, commit $(git rev-parse --short HEAD 2>/dev/null), logs in $D"

: >$D/daemon.out
$B/stacklensd --socket $S --metrics-address off --log-level info >$D/daemon.out 2>$D/daemon.log & DP=$!
T=()
cleanup() {
  kill "${T[@]}" 2>/dev/null; kill -TERM $DP 2>/dev/null
  wait "${T[@]}" $DP 2>/dev/null
}
trap cleanup EXIT
for i in $(seq 150); do grep -q ready $D/daemon.out && break; sleep 0.2; done
grep -q ready $D/daemon.out || { echo "stacklensd did not start:"; tail -5 $D/daemon.log; exit 2; }

started() {  # PID FILE: wait up to 300 s for the target's "ready" (torch imports slowly on a busy machine)
  for i in $(seq 1500); do grep -q ready "$2" && return 0; kill -0 "$1" 2>/dev/null || break; sleep 0.2; done
  echo "target $1 did not start: $(tail -3 "$2")"; exit 2
}
$B/python tests/targets/inject_sleep.py >$D/quiet.out 2>&1 & QUIET=$!; T+=($QUIET)
started $QUIET $D/quiet.out
a0=$(date +%s.%N)
$B/stacklens --socket $S attach $QUIET >$D/attach_quiet 2>&1 || { echo "attach quiet failed: $(cat $D/attach_quiet)"; exit 2; }
$B/python tests/targets/dataloader_epochs.py "${WORKERS:-2}" ${HOSTILE:+cut} >$D/loader.out 2>&1 & LOADER=$!; T+=($LOADER)
started $LOADER $D/loader.out
$B/stacklens --socket $S attach $LOADER >$D/attach_loader 2>&1 || { echo "attach loader failed: $(cat $D/attach_loader)"; exit 2; }
printf "attached: quiet %d, loader %d (%.1f s for both attaches)\n" $QUIET $LOADER "$(echo "$(date +%s.%N) - $a0" | bc)"

samples() {  # PID -> the CPU samples in its profile so far (-1: no answer)
  $B/python - "$S" "$1" <<'EOF' 2>>$D/samples.err || echo -1
import sys
from stacklens.daemon.client import DaemonClient
with DaemonClient(sys.argv[1], timeout=60) as c:
    print(int(c.snapshot(int(sys.argv[2])).total("cpu_samples")))
EOF
}

t0=$(date +%s); polls=0; bad=0; frozen=0; last=$(samples $LOADER); first_bad=""; minute=60
while :; do
  el=$(( $(date +%s) - t0 ))
  [ $el -ge $DURATION ] && break
  $B/stacklens --socket $S ps >$D/ps.now 2>&1; polls=$((polls + 1))
  { echo "== +${el}s"; cat $D/ps.now; } >>$D/ps.log
  for pid in $QUIET $LOADER; do
    st=$(awk -v p=$pid '$1 == p {print $3; exit}' $D/ps.now)
    if [ "$st" != attached ]; then
      bad=$((bad + 1))
      # its row, and the line with the whole state when ps gives it one
      [ -z "$first_bad" ] && first_bad="+${el}s: $(awk -v p=$pid '$1 == p {print; getline; if ($1 == "state:") print}' $D/ps.now | tr -s ' ')"
    fi
  done
  if [ $el -ge $minute ]; then
    minute=$((minute + 60))
    n=$(samples $LOADER)
    [ "$n" -le "$last" ] && frozen=$((frozen + 1))
    printf "+%4ds: %d polls, %d not attached, loader's profile %d CPU samples (+%d)\n" $el $polls $bad $n $((n - last))
    last=$n
  fi
  [ $bad -gt 0 ] && [ -z "$KEEP_GOING" ] && break
  # on the next multiple of POLL s: a slow `ps` (a busy machine) skips a tick, neither stretches the
  # period nor makes a burst of polls after it
  now=$(date +%s); sleep $(( t0 + ((now - t0) / POLL + 1) * POLL - now ))
done

notes=$($B/python - "$S" $LOADER <<'EOF' 2>/dev/null
import sys
from stacklens.daemon.client import DaemonClient
with DaemonClient(sys.argv[1], timeout=60) as c:
    for n in c.snapshot(int(sys.argv[2])).meta.get("notes", []):
        if "read from freed" in n or "decode errors" in n:
            print(n)
EOF
)
echo "first session not attached: ${first_bad:-none}"
echo "profile notes on bad reads: ${notes:-none}"
grep -E "ended|not decodable" $D/daemon.log | head -5
alive=no; kill -0 $DP 2>/dev/null && alive=yes
verdict=PASS; { [ $bad -gt 0 ] || [ $frozen -gt 0 ] || [ $alive = no ]; } && verdict=FAIL
printf "%s: %d s, %d ps polls, %d session-polls not attached, %d minutes the profile did not grow, daemon alive %s\n" \
  $verdict $(( $(date +%s) - t0 )) $polls $bad $frozen $alive
[ $verdict = PASS ]
