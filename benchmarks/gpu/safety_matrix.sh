#!/usr/bin/env bash
# Issue 35 on the lent GPU machine, in one call (~8 minutes):
#
#   device:  bash benchmarks/gpu/safety_matrix.sh [ARGS]     (carry [".device"]; results under $OUT)
#
# The BCC bundle and cupti-python from .device (../shared/device/README.md), stacklens importable
# from the repository, then benchmarks/gpu/safety_matrix.py (its docstring says what it counts).
set -uo pipefail
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$REPO"
OUT=${OUT:-/tmp/stacklens-safety-out}
mkdir -p "$OUT"
if [ -z "${PY:-}" ]; then
  if command -v python3 >/dev/null && python3 -c "import torch" 2>/dev/null; then PY=$(command -v python3)
  elif [ -x /opt/torch/.venv/bin/python3 ]; then PY=/opt/torch/.venv/bin/python3
  else PY=python3; fi
fi
# shellcheck disable=SC1091
source .device/use-bcc.sh || echo "safety_matrix: .device/use-bcc.sh failed: pass carry [\".device\"]"
"$PY" -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .device/whl/*.whl 2>&1 | tail -3
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}/tmp/site
SLPATH=$(mktemp -d /tmp/stacklens-path.XXXXXX)   # the package `stacklens` is the repository root
ln -s "$REPO" "$SLPATH/stacklens"
export PYTHONPATH=$SLPATH:$PYTHONPATH PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$OUT/machine.txt" 2>&1; true
timeout -k 10 "${LIMIT_S:-570}" "$PY" benchmarks/gpu/safety_matrix.py --out "$OUT/run" "$@" 2>&1 | tee "$OUT/safety_matrix.log"
rc=${PIPESTATUS[0]}
cp "$OUT/run/safety_matrix.json" "$OUT/run/safety_matrix.md" "$OUT/" 2>/dev/null
tar -C "$OUT/run" -czf "$OUT/logs.tar.gz" . 2>/dev/null && rm -rf "$OUT/run"
rm -f "$SLPATH/stacklens"; rmdir "$SLPATH"
exit "$rc"
