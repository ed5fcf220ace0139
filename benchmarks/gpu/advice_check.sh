#!/usr/bin/env bash
# Issue 44 on the lent GPU machine, in one call (~3 minutes expected, at most 6: the two time limits, 130 + 210 s):
#
#   device:  bash benchmarks/gpu/advice_check.sh      (no carry needed; results under $OUT)
#
# 1. benchmarks/gpu/gemm_speedups.py: GEMM time fp32 / TF32 / bf16 by shape and kernel, at most
#    ~2 minutes -> $OUT/gemm_speedups.json (commit it as analyzer/data/gemm_speedups.json).
# 2. benchmarks/gpu/advice_check.py: each finding's fix applied to a job (TF32 on GPT-2 and
#    ResNet-50 training, CUDA graphs on batch-1 decoding, a per-step .item() removed), measured,
#    with the rule's estimate from the fresh table -> $OUT/advice_check.json and .md.
# No BPF or agent here: env.sh's BCC and wheel steps only print that .device was not carried.
set -uo pipefail
# shellcheck disable=SC1091
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
"$PY" -c "import torch, sys; print('torch', torch.__version__, torch.cuda.get_device_name(0), 'python', sys.version.split()[0])" 2>&1 | tee "$OUT/advice_check.log"
timeout -k 10 "${GEMM_LIMIT_S:-130}" "$PY" benchmarks/gpu/gemm_speedups.py --out "$OUT/gemm_speedups.json" \
  --budget-s "${GEMM_BUDGET_S:-95}" 2>&1 | tee -a "$OUT/advice_check.log"
rc1=${PIPESTATUS[0]}
table=()
[ -s "$OUT/gemm_speedups.json" ] && table=(--table "$OUT/gemm_speedups.json")
timeout -k 10 "${ADVICE_LIMIT_S:-210}" "$PY" benchmarks/gpu/advice_check.py --out "$OUT/advice_check.json" \
  "${table[@]}" --budget-s "${ADVICE_BUDGET_S:-150}" "$@" 2>&1 | tee -a "$OUT/advice_check.log"
rc2=${PIPESTATUS[0]}
rm -f "$SLPATH/stacklens"; rmdir "$SLPATH"
echo "gemm_speedups rc=$rc1 advice_check rc=$rc2" | tee -a "$OUT/advice_check.log"
[ "$rc1" -eq 0 ] && [ "$rc2" -eq 0 ]
