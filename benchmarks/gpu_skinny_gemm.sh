#!/usr/bin/env bash
# One device call (~4 minutes on an H200): ops/skinny_gemm.py's GPU tests (bf16 at Llama-2-7B's four projection
# shapes against the float64 loop, graph replays), then bench_skinny_gemm.py: cuBLAS under PyTorch's BLAS settings
# against skinny_linear's tile sweep at 32 rows (the fastest three retried at 16, 8 and 1), and a layer's four
# projections in order. Built (2026-12-02, seventeenth session) for issue 5's backbone decode step (1.32-1.35× its
# floor against 1.3×), whose GEMMs stream the weights at ~0.84 of the copy bandwidth.
#   OUT=/some/dir bash benchmarks/gpu_skinny_gemm.sh
set -u
OUT=${OUT:-benchmarks/results}
. "$(dirname "$0")/gpu_cache.sh"
gpu_script_start
if [ "${TESTS:-1}" = 1 ]; then
  echo "== GPU tests at ${SECONDS}s"
  timeout ${TEST_S:-120} python -m pytest -m gpu -q -rA -p no:cacheprovider tests/test_skinny_gemm.py 2>&1 \
      | tee "$OUT/pytest_gpu_skinny_gemm.log" | grep -E "PASSED|FAILED|ERROR|passed|failed" | tail -16
fi
echo "== bench at ${SECONDS}s"
timeout ${BENCH_S:-400} python benchmarks/bench_skinny_gemm.py --out "$OUT/skinny_gemm.json" --md "$OUT/skinny_gemm.md" 2>&1 \
    | tail -24
echo "== done at ${SECONDS}s"
