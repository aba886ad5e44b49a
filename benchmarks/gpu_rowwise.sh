#!/usr/bin/env bash
# One device call (~5 minutes on an H200): are the row-wise decode kernels (sgmv._shrink_tile_rows,
# _expand_tile_rows; LORAPLEX_LORA_ROWWISE) worth turning on? Whole decode forwards at 32 and 160 rows
# (backbone, distinct, shared) in modes 0 (off), 1 (tiles of ≤ 4 rows, one kernel with both paths) and
# 2 (every tile); the kernels apart (probe_expand_rowwise.py); the engine test of "auto" (decode graphs in
# mode 0 and 2, each step replaying the one its adapters fit); then the GPU kernel tests in mode 1.
# (bench_model's 160 shared rows get 64-row tiles, which have no row-wise path: only 32 shows shared.)
#   OUT=/some/dir bash benchmarks/gpu_rowwise.sh
# Triton's compile cache comes back in 15 MB parts, as in gpu_mixed_graphs.sh.
set -u
OUT=${OUT:-benchmarks/results}
. "$(dirname "$0")/gpu_cache.sh"
restore_triton_cache
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
for rw in 0 1 2; do
  echo "== decode forwards, LORAPLEX_LORA_ROWWISE=$rw, at ${SECONDS}s"
  LORAPLEX_LORA_ROWWISE=$rw timeout 90 python benchmarks/bench_model.py --batches 32,160 --prefill 1x16 \
      --out "$OUT/model_forward_rowwise_$rw.json" 2>&1 | grep -E "^decode"
done
echo "== kernels apart at ${SECONDS}s"
timeout 180 python benchmarks/probe_expand_rowwise.py --out "$OUT/probe_lora_rowwise.json" 2>&1 | grep -E "^M="
echo "== engine, LORAPLEX_LORA_ROWWISE=auto, at ${SECONDS}s"
timeout 120 python -m pytest -m gpu -q -p no:cacheprovider tests/test_engine_gpu.py -k row_wise 2>&1 \
    | tee "$OUT/pytest_gpu_engine_rowwise.log" | tail -2
left=$((560 - SECONDS))
if [ "$left" -gt 20 ]; then
  echo "== GPU kernel tests, mode 1, at ${SECONDS}s"
  LORAPLEX_LORA_ROWWISE=1 timeout "$left" python -m pytest -m gpu -q -p no:cacheprovider tests/test_ops_gpu.py \
      2>&1 | tee "$OUT/pytest_gpu_ops_rowwise.log" | tail -3
fi
save_triton_cache
echo "== done at ${SECONDS}s"
