#!/usr/bin/env bash
# One device call (~8 minutes on an H200, with the first call's Triton cache): (1) the GPU tests with
# LORAPLEX_PDL=on (ops/pdl.py: the launch attribute, graph replays against eager, the engine against
# transformers); (2) probe_prefill_lora.py's eager prompt forwards, the default prompt config against "store"
# (ops/stored_lora.py), alternating round by round, with the GEMMs' and all kernels' GPU time; (3) issue 5's
# engine benchmark with PDL on and both prompt configs, 5 runs each, while time is left.
#   OUT=/some/dir bash benchmarks/gpu_pdl_check.sh
set -u
OUT=${OUT:-benchmarks/results}
. "$(dirname "$0")/gpu_cache.sh"
gpu_script_start
DEADLINE=${DEADLINE:-575}
which="pdl or decode_graph_replays_new or mixed_graph_replays or mixed_bf16 or graphs_and_eager_give or seeded"
LORAPLEX_PDL=on gpu_tests pytest_gpu_pdl.log "${TEST_S:-170}" tests/test_pdl.py tests/test_model_gpu.py \
    tests/test_engine_gpu.py -k "$which"
echo "== prompt forwards, default against store, at ${SECONDS}s"
LORAPLEX_PDL=on timeout 150 python benchmarks/probe_prefill_lora.py --variants ";store" --rounds 5 \
    --out "$OUT/probe_prefill_store.json" 2>&1 | grep -E "µs|Error" | tail -12
[ "$(left)" -gt 250 ] && REPEATS=5 ENGINE_ARGS="--prefill ;store" engine_each LORAPLEX_PDL pdl_store5 on
save_triton_cache
echo "== done at ${SECONDS}s"
