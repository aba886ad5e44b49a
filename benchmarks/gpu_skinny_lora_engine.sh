#!/usr/bin/env bash
# One device call (~9.5 minutes on an H200): the engine's GPU tests with LORAPLEX_SKINNY_LORA=on (graphs against
# eager against transformers + PEFT), then issue 5's benchmark at batch 32 (backbone and distinct adapters, 3 runs
# each) with LORAPLEX_SKINNY_LORA on and off, each in its own process.
#   OUT=/some/dir bash benchmarks/gpu_skinny_lora_engine.sh
set -u
OUT=${OUT:-benchmarks/results}
. "$(dirname "$0")/gpu_cache.sh"
gpu_script_start
DEADLINE=${DEADLINE:-580}
gpu_tests pytest_gpu_skinny_lora_engine.log "${TEST_S:-100}" tests/test_engine_gpu.py -k "skinny_gemm"
engine_each LORAPLEX_SKINNY_LORA skinny_lora ${VALUES:-on off}
save_triton_cache
echo "== done at ${SECONDS}s"
