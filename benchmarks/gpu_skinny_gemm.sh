#!/usr/bin/env bash
# One device call (~9 minutes on an H200): ops/skinny_gemm.py, built (2026-12-02, seventeenth session) for issue
# 5's backbone decode step (1.32-1.35× its floor against 1.3×), whose cuBLAS GEMMs stream the weights at ~0.84 of
# the copy bandwidth. (1) Its GPU tests (bf16 at Llama-2-7B's projection shapes against the float64 loop, graph
# replays); (2) bench_skinny_gemm.py: cuBLAS under PyTorch's BLAS settings against the kernel's tile sweep at 32
# rows (the fastest three at 16, 8 and 1) and a layer's four projections in order, writing the fastest config per
# shape; (3) batch-32 decode forwards in graphs with those configs, paired rounds: backbone and today's path, each
# with and without the kernel (LORAPLEX_SKINNY_GEMM), SiLU's product at 256 columns in 4 warps and with both B
# blocks loaded first; (4) issue 5's engine benchmark with the kernel on, then (time left) off. Returns the
# Triton cache entries it compiled.
#   OUT=/some/dir bash benchmarks/gpu_skinny_gemm.sh
# TESTS=0 / BENCH=0 skip a part (a second call: TESTS=0 BENCH=0 LORAPLEX_SKINNY_CONFIGS=<the first call's
# skinny_configs.json, committed> runs the forwards and the engine alone); DEADLINE as in gpu_cache.sh.
set -u
OUT=${OUT:-benchmarks/results}
. "$(dirname "$0")/gpu_cache.sh"
gpu_script_start
DEADLINE=${DEADLINE:-570}
gpu_tests pytest_gpu_skinny_gemm.log "${TEST_S:-120}" tests/test_skinny_gemm.py
if [ "${BENCH:-1}" = 1 ]; then
  echo "== bench at ${SECONDS}s"
  timeout ${BENCH_S:-300} python benchmarks/bench_skinny_gemm.py --out "$OUT/skinny_gemm.json" --md "$OUT/skinny_gemm.md" \
      --configs-out "$OUT/skinny_configs.json" 2>&1 | tail -24
  [ -s "$OUT/skinny_configs.json" ] && export LORAPLEX_SKINNY_CONFIGS=$OUT/skinny_configs.json
fi
if [ "$(left)" -gt 120 ]; then
  echo "== decode forwards at ${SECONDS}s (configs: ${LORAPLEX_SKINNY_CONFIGS:-pick_config})"
  timeout $(($(left) - 60)) python benchmarks/trace_decode_graph.py --variants backbone,backbone+skinny,fused,fused+skinny,silu256+silu_w4,silu_loads_first \
      --trace-variants backbone+skinny --paired 7 --out "$OUT/decode_graph_trace_skinny.json" 2>&1 \
      | grep -E "^[a-z_0-9+]+ +[0-9]+ µs|^paired" | tail -10
fi
engine_each LORAPLEX_SKINNY_GEMM skinny on off
save_triton_cache
echo "== done at ${SECONDS}s"
