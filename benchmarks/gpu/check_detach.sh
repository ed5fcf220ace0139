#!/usr/bin/env bash
# Issue 20, acceptance 2 on the lent GPU machine, in one call (~5 minutes):
#
#   device:  bash benchmarks/gpu/check_detach.sh        (carry: [".device"]; results under $OUT)
#
# The environment of run_all.sh (the BCC bundle, cupti-python for the targets, stacklens
# importable), then benchmarks/gpu/check_detach.py, pinned (PIN_TARGET, default 4-7; PIN_BENCH,
# default 8-15). Extra arguments go to it (e.g. --workloads launch --variants finalize).
# $OUT receives check_detach.json, check_detach.md, check_detach.log and targets.log.
set -uo pipefail
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$REPO"
OUT=${OUT:-/tmp/stacklens-detach-out}
mkdir -p "$OUT"
if [ -z "${PY:-}" ]; then  # the python that has torch: python3 on PATH, else the venv's
  if command -v python3 >/dev/null && python3 -c "import torch" 2>/dev/null; then PY=$(command -v python3)
  elif [ -x /opt/torch/.venv/bin/python3 ]; then PY=/opt/torch/.venv/bin/python3
  else PY=python3; fi
fi
# shellcheck disable=SC1091
source .device/use-bcc.sh || echo "check_detach: .device/use-bcc.sh failed: pass carry [\".device\"]"
"$PY" -m pip install -q --no-index --no-deps --target /tmp/site .device/whl/*.whl 2>&1 | tail -3
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}/tmp/site
SLPATH=$(mktemp -d /tmp/stacklens-path.XXXXXX)   # the package `stacklens` is the repo root
ln -s "$REPO" "$SLPATH/stacklens"
export PYTHONPATH=$SLPATH:$PYTHONPATH PYTHONUNBUFFERED=1
timeout -k 10 570 "$PY" benchmarks/gpu/check_detach.py --out "$OUT" --deadline-s 520 \
  --pin-target "${PIN_TARGET:-4-7}" --pin-bench "${PIN_BENCH:-8-15}" "$@" 2>&1 | tee "$OUT/check_detach.log"
rc=${PIPESTATUS[0]}
rm -f "$SLPATH/stacklens"; rmdir "$SLPATH"
exit "$rc"
