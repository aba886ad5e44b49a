#!/usr/bin/env bash
# Device call for the prompt rows' LoRA through cuBLAS (benchmarks/probe_prefill_cublas.py), 2026-12-03:
# the probe (~1-2 min), then, while time is left, batch-32 Llama-2-7B decode forwards in CUDA graphs with the
# backbone's and today's path's timelines (where the distinct decode step's extra time goes, kernel by kernel).
#   OUT=/some/dir bash benchmarks/gpu_prefill_cublas.sh
set -u
OUT=${OUT:-benchmarks/results}
. "$(dirname "$0")/gpu_cache.sh"
gpu_script_start
DEADLINE=${DEADLINE:-500}
echo "== probe at ${SECONDS}s"
timeout $(($(left) - 20)) python benchmarks/probe_prefill_cublas.py --out "$OUT/probe_prefill_cublas${TAG:+_$TAG}.json" \
    2>&1 | grep -v '^{' | tail -8
if [ "${TRACE:-1}" = 1 ] && [ "$(left)" -gt 150 ]; then
  echo "== decode forwards at ${SECONDS}s"
  timeout $(($(left) - 20)) python benchmarks/trace_decode_graph.py --batch 32 --variants "${VARIANTS:-backbone,fused}" \
      --trace-variants "${TRACE_VARIANTS:-backbone,fused}" --paired "${ROUNDS:-5}" \
      --out "$OUT/decode_graph_trace_backbone${TAG:+_$TAG}.json" 2>&1 \
      | grep -E "^[a-z_0-9+]+ +[0-9]+ µs|^paired|Error|error" | tail -16
fi
save_triton_cache
echo "== done at ${SECONDS}s"
