# Sourced by the GPU-machine scripts (safety_matrix.sh, oneshot_start.sh): PY (a python with torch),
# the BCC bundle and cupti-python from .device (../shared/device/README.md), stacklens importable
# from the repository (the package is the repository root), OUT, NVLink multicast off.
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$REPO"
OUT=${OUT:-/tmp/stacklens-gpu-out}
mkdir -p "$OUT"
if [ -z "${PY:-}" ]; then
  if command -v python3 >/dev/null && python3 -c "import torch" 2>/dev/null; then PY=$(command -v python3)
  elif [ -x /opt/torch/.venv/bin/python3 ]; then PY=/opt/torch/.venv/bin/python3
  else PY=python3; fi
fi
# shellcheck disable=SC1091
source .device/use-bcc.sh || echo "env.sh: .device/use-bcc.sh failed: pass carry [\".device\"]"
"$PY" -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .device/whl/*.whl 2>&1 | tail -3
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}/tmp/site
SLPATH=$(mktemp -d /tmp/stacklens-path.XXXXXX)
ln -s "$REPO" "$SLPATH/stacklens"
export PYTHONPATH=$SLPATH:$PYTHONPATH PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$OUT/machine.txt" 2>&1; true
