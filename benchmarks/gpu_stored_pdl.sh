#!/usr/bin/env bash
# One device call (~9 minutes on an H200, no Triton cache): (1) the GPU tests of ops/stored_lora.py (the prompt
# steps' expand stored into the projection's output before the GEMM adds to it; nineteenth session) and of the
# prompt tiles' expand options; (2) issue 5's engine benchmark with LORAPLEX_PDL off, then on (ops/pdl.py,
# built in the eighteenth session, first GPU run), each in its own process (PDL is fixed at import), each
# running the distinct adapters with the default prompt config and with "store" (KernelConfig.store_first)
# interleaved in the same engine. Returns the Triton cache entries it compiled.
#   OUT=/some/dir bash benchmarks/gpu_stored_pdl.sh
set -u
OUT=${OUT:-benchmarks/results}
. "$(dirname "$0")/gpu_cache.sh"
gpu_script_start
DEADLINE=${DEADLINE:-575}
gpu_tests pytest_gpu_stored.log "${TEST_S:-120}" tests/test_stored_lora.py tests/test_ops_gpu.py \
    -k "prompt_step_shapes or prefill_expand"
ENGINE_ARGS="--prefill ;store" engine_each LORAPLEX_PDL pdl_store off on
save_triton_cache
echo "== done at ${SECONDS}s"
