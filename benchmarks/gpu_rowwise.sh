#!/usr/bin/env bash
# One device call (~5 minutes on an H200): the row-wise decode kernels' options (LORAPLEX_LORA_ROWS: loads a
# step ahead, 512 columns a step; sgmv.KernelConfig.rows_prefetch / rows_block_n). Whole decode forwards at
# 32 and 160 rows (backbone, distinct, shared) with each option set, side by side; the kernels apart
# (probe_expand_rowwise.py); the GPU tests of the row-wise kernels (float64 loop) and of the engine's "auto"
# mode. (2026-12-01's eighth session ran the modes 0/1/2 this way and made mode 1 the default.)
#   OUT=/some/dir bash benchmarks/gpu_rowwise.sh
set -u
OUT=${OUT:-benchmarks/results}
. "$(dirname "$0")/gpu_cache.sh"
restore_triton_cache
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
for rows in "" "prefetch" "prefetch,n512" "n512"; do
  tag=${rows:-plain}
  echo "== decode forwards, LORAPLEX_LORA_ROWS=$rows, at ${SECONDS}s"
  LORAPLEX_LORA_ROWS=$rows timeout 90 python benchmarks/bench_model.py --batches 32,160 --prefill 1x16 \
      --out "$OUT/model_forward_rows_${tag//,/_}.json" 2>&1 | grep -E "^decode"
done
echo "== kernels apart at ${SECONDS}s"
timeout 200 python benchmarks/probe_expand_rowwise.py --out "$OUT/probe_lora_rows_options.json" 2>&1 | grep -E "^M="
save_triton_cache
left=$((560 - SECONDS))
if [ "$left" -gt 20 ]; then
  echo "== GPU tests at ${SECONDS}s"
  timeout "$left" python -m pytest -m gpu -q -p no:cacheprovider tests/test_ops_gpu.py tests/test_engine_gpu.py \
      -k "rowwise or row_wise" 2>&1 | tee "$OUT/pytest_gpu_rows_options.log" | tail -3
fi
echo "== done at ${SECONDS}s"
