#!/usr/bin/env bash
# Device calls for LORAPLEX_LORA_EARLY_READS (ops/pdl.py's early reads: the LoRA consumers RoPE, SiLU-and-mul and
# the split RMSNorm read their rows' slots, ranks, scalings and B blocks before the PDL wait) and
# LORAPLEX_LORA_RMS_ONE_LAUNCH (the split RMSNorm in one launch), 2026-12-03:
# PART=trace (~3-8 min, more without a carried Triton cache): the GPU tests of the consumers with and without
#   them (graph replays, the float64 sums) and of PDL's launches; batch-32 Llama-2-7B decode forwards in CUDA
#   graphs, paired rounds: backbone, today's path and VARIANTS.
# PART=all: both; the engine's "on" processes also with LORAPLEX_LORA_RMS_ONE_LAUNCH=on where early_reads+rms_one
#   beat early_reads in the rounds.
# PART=engine (~30 s a process with a warm cache): issue 5's engine benchmark at batch 32, one process per value
#   of VAR (default LORAPLEX_LORA_EARLY_READS) in VALUES (REPEATS runs each; ENV: more settings for every
#   process, e.g. ENV="LORAPLEX_LORA_EARLY_READS=on"). A value repeated gets its own files (_2, _3, ...).
#   OUT=/some/dir PART=trace bash benchmarks/gpu_early_reads.sh
set -u
OUT=${OUT:-benchmarks/results}
. "$(dirname "$0")/gpu_cache.sh"
gpu_script_start
DEADLINE=${DEADLINE:-560}
if [ "${PART:-trace}" != engine ]; then
  gpu_tests pytest_gpu_early_reads${TAG:+_$TAG}.log "${TEST_S:-150}" tests/test_lora_product_gpu.py tests/test_pdl.py \
      -k "${TEST_K:-lora_product_consumers or rms_norm_with_rows or programmatic}"
  echo "== decode forwards at ${SECONDS}s"
  timeout $(($(left) - 30)) python benchmarks/trace_decode_graph.py --batch 32 \
      --variants "${VARIANTS:-backbone,fused,early_reads,early_silu,early_rope,early_rms}" \
      --trace-variants "${TRACE_VARIANTS:-fused,early_reads}" \
      --paired "${ROUNDS:-9}" --out "$OUT/decode_graph_trace_early${TAG:+_$TAG}.json" 2>&1 \
      | grep -E "^[a-z_0-9+]+ +[0-9]+ µs|^paired|Error|error" | tail -16
fi
if [ "${PART:-trace}" = all ]; then   # the engine next, with the split RMSNorm in one launch if it won the rounds
  ON_ENV=$(python - "$OUT/decode_graph_trace_early${TAG:+_$TAG}.json" <<'PY'
import json, sys
paired = json.load(open(sys.argv[1])).get("paired", {})
one, early = paired.get("early_reads+rms_one", {}), paired.get("early_reads", {})
better = one and early and one["median_us"] < early["median_us"]
print("LORAPLEX_LORA_RMS_ONE_LAUNCH=on" if better else "")
PY
)
  echo "== the engine's setting beside early reads: '${ON_ENV}'"
fi
if [ "${PART:-trace}" != trace ]; then
  declare -A seen=()
  for value in ${VALUES:-off on}; do
    [ "$(left)" -gt 60 ] || break
    seen[$value]=$((${seen[$value]:-0} + 1))
    name="engine_early${TAG:+_$TAG}_$value"
    [ "${seen[$value]}" = 1 ] || name="${name}_${seen[$value]}"
    extra=${ENV:-}
    [ "$value" = on ] && extra="$extra ${ON_ENV:-}"
    echo "== engine, ${VAR:-LORAPLEX_LORA_EARLY_READS}=$value $extra at ${SECONDS}s"
    env $extra "${VAR:-LORAPLEX_LORA_EARLY_READS}=$value" timeout $(($(left) - 5)) python benchmarks/bench_engine.py \
        --batches 32 --modes graphs --variants backbone,distinct --repeats "${REPEATS:-3}" --out "$OUT/$name.json" \
        --md "$OUT/$name.md" 2>&1 | grep -E "^\| 32|Error"
  done
fi
save_triton_cache
echo "== done at ${SECONDS}s"
