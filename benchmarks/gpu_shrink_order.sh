#!/usr/bin/env bash
# Device calls for LORAPLEX_LORA_SHRINK_ORDER (ops/overlap.py: where the "fused" projections' shrink runs), 2026-12-03:
# PART=trace (~3-5 min): batch-32 Llama-2-7B decode forwards in CUDA graphs, paired rounds: backbone, today's path
#   and VARIANTS (each checked against today's logits: max_abs_vs_fused), with TRACE_VARIANTS' timelines; then,
#   while time is left, the GPU tests (TEST_K) with LORAPLEX_LORA_SHRINK_ORDER=after (the default since the calls
#   of 2026-12-03, which ran this script with "side" the default: the variants' defaults are now the other orders).
# PART=engine: issue 5's engine benchmark at batch 32 via gpu_early_reads.sh with VAR=LORAPLEX_LORA_SHRINK_ORDER
#   (VALUES, REPEATS, ENV as there).
#   OUT=/some/dir PART=trace bash benchmarks/gpu_shrink_order.sh
set -u
OUT=${OUT:-benchmarks/results}
if [ "${PART:-trace}" = engine ]; then
  VAR=LORAPLEX_LORA_SHRINK_ORDER TAG=${TAG:-order} PART=engine exec bash "$(dirname "$0")/gpu_early_reads.sh"
fi
. "$(dirname "$0")/gpu_cache.sh"
gpu_script_start
DEADLINE=${DEADLINE:-540}
echo "== decode forwards at ${SECONDS}s"
timeout $(($(left) - 30)) python benchmarks/trace_decode_graph.py --batch 32 \
    --variants "${VARIANTS:-backbone,fused,shrink_side,shrink_before}" \
    --trace-variants "${TRACE_VARIANTS:-fused}" --paired "${ROUNDS:-5}" \
    --out "$OUT/decode_graph_trace_order${TAG:+_$TAG}.json" 2>&1 \
    | grep -E "^[a-z_0-9+]+ +[0-9]+ µs|^paired|Error|error" | tail -16
if [ "$(left)" -gt 90 ]; then
  LORAPLEX_LORA_SHRINK_ORDER=after gpu_tests pytest_gpu_shrink_after${TAG:+_$TAG}.log $(($(left) - 20)) \
      tests/test_model_gpu.py tests/test_engine_gpu.py tests/test_pdl.py -k "${TEST_K:-decode or graph or programmatic}"
fi
save_triton_cache
echo "== done at ${SECONDS}s"
