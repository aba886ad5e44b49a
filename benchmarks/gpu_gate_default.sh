#!/usr/bin/env bash
# One device call (~8 minutes on an H200) after gpu_gate_silu.sh (2026-12-02, seventeenth session), with that
# call's findings as defaults: gate/up's product left to SiLU-and-mul in decode forwards of 5-32 rows
# (overlap.DECODE_EXTRA_FUSED) and RoPE's B tiles at the exact mask (LORAPLEX_LORA_VECTOR_LOADS=no-rope).
# (1) the GPU tests of decode graphs on the "fused" path at 7B/8B shapes and the engine's graphs against
# transformers; (2) batch-32 decode forwards, paired rounds: today's default against the default before
# (no_gate), SiLU in 8 warps (512 and 256 columns a program); batch 16 against no_gate; (3) issue 5's engine
# benchmark at batch 32.
#   OUT=/some/dir bash benchmarks/gpu_gate_default.sh
set -u
OUT=${OUT:-benchmarks/results}
. "$(dirname "$0")/gpu_cache.sh"
gpu_script_start
DEADLINE=${DEADLINE:-560}
gpu_tests pytest_gpu_gate_default.log "${TEST_S:-150}" tests/test_model_gpu.py tests/test_engine_gpu.py \
    -k "${TEST_K:-(replays_new_batches and fused and not o_in and not gemm_stream) or (shared_adapter and fused) or graphs_and_eager}"
run_trace() {   # name, batch, variants, rounds
  [ "$(left)" -gt 60 ] || return 0
  echo "== decode forward $1 at batch $2 at ${SECONDS}s"
  timeout $(($(left) - 20)) python benchmarks/trace_decode_graph.py --batch "$2" --variants "$3" --trace-variants fused \
      --paired "$4" --out "$OUT/decode_graph_trace_$1.json" 2>&1 | grep -E "^[a-z_0-9+]+ +[0-9]+ µs|^paired" | tail -12
}
if [ "${TRACE:-1}" = 1 ]; then
  run_trace gate_default 32 backbone,fused,no_gate,silu_w8,silu256+silu_w8 7
  run_trace gate_default_b16 16 backbone,fused,no_gate 5
fi
if [ "${ENGINE:-1}" = 1 ] && [ "$(left)" -gt 120 ]; then
  echo "== engine at ${SECONDS}s"
  timeout $(($(left) - 5)) python benchmarks/bench_engine.py --batches 32 --modes graphs --variants backbone,distinct \
      --repeats 3 --out "$OUT/engine_gate_default.json" --md "$OUT/engine_gate_default.md" 2>&1 | grep "^| 32"
fi
echo "== done at ${SECONDS}s"
