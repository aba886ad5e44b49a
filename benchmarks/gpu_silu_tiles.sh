#!/usr/bin/env bash
# Device calls for LORAPLEX_LORA_SILU_TILES (ops/silu_lora_tiles.py: SiLU-and-mul expands gate/up's LoRA product
# over the prompt steps' work tiles instead of the expand's read-modify-write), 2026-12-03:
# PART=probe (~4-6 min): its GPU tests (7B widths against the float64 loop, graph replays; the model's mixed
#   batches against transformers + PEFT and graph replays; the engine's graphs and eager against transformers),
#   then benchmarks/probe_silu_tiles.py (per layer: the expand then SiLU against the tile consumer's settings).
# PART=engine: issue 5's engine benchmark at batch 32 via gpu_early_reads.sh with VAR=LORAPLEX_LORA_SILU_TILES
#   (VALUES, REPEATS, ENV as there; ENV="LORAPLEX_LORA_SILU_TILES_CONFIG=128x8" picks the consumer's settings).
#   OUT=/some/dir PART=probe bash benchmarks/gpu_silu_tiles.sh
set -u
OUT=${OUT:-benchmarks/results}
if [ "${PART:-probe}" = engine ]; then
  VAR=LORAPLEX_LORA_SILU_TILES TAG=${TAG:-silu} PART=engine exec bash "$(dirname "$0")/gpu_early_reads.sh"
fi
. "$(dirname "$0")/gpu_cache.sh"
gpu_script_start
DEADLINE=${DEADLINE:-560}
gpu_tests pytest_gpu_silu_tiles${TAG:+_$TAG}.log "${TEST_S:-300}" tests/test_silu_lora_tiles_gpu.py \
    tests/test_model_gpu.py tests/test_engine_gpu.py \
    -k "${TEST_K:-test_silu_lora_tiles_gpu or mixed_bf16 or mixed_graph_replays or silu_expanding}"
echo "== probe at ${SECONDS}s"
timeout $(($(left) - 20)) python benchmarks/probe_silu_tiles.py --out "$OUT/probe_silu_tiles${TAG:+_$TAG}.json" 2>&1 \
    | tail -8
save_triton_cache
echo "== done at ${SECONDS}s"
